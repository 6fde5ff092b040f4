"""Run model-written Python in a contained child process: `run_python(code) -> Execution` (see parent.py)."""
from grpo.sandbox.parent import STATUSES, Execution, Limits, isolation, python_tool_result, run_python

__all__ = ["STATUSES", "Execution", "Limits", "isolation", "python_tool_result", "run_python"]
