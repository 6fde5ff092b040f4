"""Tasks: prompts with reference answers, split into train and held-out."""
from grpo.tasks.arithmetic import BUILTIN_TASKS, BuiltinTask, load_builtin_task
from grpo.tasks.base import Example, Task


def load_task(data, seed: int, *, train_dataset=None, eval_dataset=None) -> Task:
    """The task a `DataConfig` names: a data set when `data.path` is set, else a built-in task.
    `train_dataset` / `eval_dataset` (`grpo.train`: a `datasets.Dataset`, an `IterableDataset` or a list of
    dicts) take the place of `data.path` / `data.eval_path`, read by the same column rules."""
    if not data.path and train_dataset is None:
        if eval_dataset is not None:
            from grpo.errors import ConfigError
            raise ConfigError("eval_dataset is given without training data: give train_dataset or data.path too")
        return load_builtin_task(data.task, seed)
    from grpo.tasks.hf import load_dataset_task
    return load_dataset_task(train_dataset if train_dataset is not None else data.path,
                             prompt_column=data.prompt_column, answer_column=data.answer_column,
                             image_column=data.image_column,
                             split=data.split, config_name=data.config_name or None,
                             eval_path=eval_dataset if eval_dataset is not None else data.eval_path or None,
                             eval_split=data.eval_split or None, eval_fraction=data.eval_fraction, seed=seed)


__all__ = ["BUILTIN_TASKS", "BuiltinTask", "Example", "Task", "load_builtin_task", "load_task"]
