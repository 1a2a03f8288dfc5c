"""Tasks: model + data + objective. ``get_task(name)`` resolves a built-in name or a
user's ``module:function`` that returns a :class:`Task`."""

from __future__ import annotations

import importlib

from fedswarm.errors import ConfigError
from fedswarm.tasks.base import Task, TaskData
from fedswarm.tasks.builtin import BUILTIN_TASKS
from fedswarm.tasks.deep import DEEP_TASKS
from fedswarm.tasks.hf import HF_TASKS
from fedswarm.tasks.large import LARGE_TASKS
from fedswarm.tasks.staged import STAGED_TASKS

__all__ = ["Task", "TaskData", "get_task", "task_names", "TASKS"]

TASKS: dict[str, Task] = {**BUILTIN_TASKS, **HF_TASKS, **STAGED_TASKS, **LARGE_TASKS, **DEEP_TASKS}


def task_names() -> list[str]:
    return list(TASKS)


def get_task(name: str) -> Task:
    if name in TASKS:
        return TASKS[name]
    if ":" in name:
        mod_name, _, fn_name = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"invalid value for 'task': cannot load '{name}' ({exc})") from None
        task = fn()
        if not isinstance(task, Task):
            raise ConfigError(f"invalid value for 'task': '{name}' returned {type(task).__name__}, not a fedswarm Task")
        return task
    raise ConfigError(
        f"invalid value for 'task': unknown task '{name}' (built-in: {', '.join(TASKS)}; or 'module:function')"
    )
