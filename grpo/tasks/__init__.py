"""Tasks: prompts with reference answers, split into train and held-out."""
from grpo.tasks.arithmetic import BUILTIN_TASKS, BuiltinTask, load_builtin_task
from grpo.tasks.base import Example, Task


def load_task(data, seed: int) -> Task:
    """The task a `DataConfig` names: a data set when `data.path` is set, else a built-in task."""
    if not data.path:
        return load_builtin_task(data.task, seed)
    from grpo.tasks.hf import load_dataset_task
    return load_dataset_task(data.path, prompt_column=data.prompt_column, answer_column=data.answer_column,
                             split=data.split, config_name=data.config_name or None,
                             eval_path=data.eval_path or None, eval_split=data.eval_split or None,
                             eval_fraction=data.eval_fraction, seed=seed)


__all__ = ["BUILTIN_TASKS", "BuiltinTask", "Example", "Task", "load_builtin_task", "load_task"]
