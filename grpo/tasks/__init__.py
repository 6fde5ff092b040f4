"""Tasks: prompts with reference answers, split into train and held-out."""
from grpo.tasks.arithmetic import BUILTIN_TASKS, BuiltinTask, load_builtin_task
from grpo.tasks.base import Example, Task

__all__ = ["BUILTIN_TASKS", "BuiltinTask", "Example", "Task", "load_builtin_task"]
