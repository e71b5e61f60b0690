"""The process a rank's ``train.grpo.tools`` calls run in (:class:`finetune.recipes.tools.ToolProcess`), so that a
call past ``train.grpo.tool_timeout_s`` can be stopped: the rank kills this process and starts another. A thread
cannot be stopped, and one running C code that holds the GIL (a huge ``**``) blocks the rank's own thread, its
timeout and its signal handlers with it.

Run as a script (``python tool_worker.py``; standard library only, so it starts without the training stack). It
reads one JSON request a line on stdin and answers each with one JSON line on the stdout it started with (the
tools' own prints go to stderr):

* ``{"load": "/abs/file.py:name"}``: import the file (once) and find the function -> ``{"ok": true}`` or
  ``{"error": "..."}``;
* ``{"call": "/abs/file.py:name", "arguments": {...}}`` -> ``{"text": ...}`` (a string result),
  ``{"text": ..., "non_text": true}`` (another result, as :func:`as_text` writes it) or ``{"error": "Type: ..."}``.

It exits at the end of stdin, and when the rank that started it is gone (its parent process changes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time


def as_text(value) -> str:
    """A tool's result that is not a string, as the model reads it: TRL 1.16's ``str(result)`` (``None`` ->
    ``"None"``, ``{"a": 1}`` -> ``"{'a': 1}"``, ``3`` -> ``"3"``); a list of text content blocks
    (``[{"type": "text", "text": ...}]``, which TRL passes to the template as multimodal content) -> their texts
    joined. Never raises (a ``__str__`` that raises gives the type's name)."""
    if isinstance(value, list) and value and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "".join(str(b.get("text", "")) for b in value)
    try:
        return str(value)
    except Exception:  # noqa: BLE001  (the user's object)
        return f"<{type(value).__name__}>"


def _function(spec: str, cache: dict):
    if spec not in cache:
        path, _, name = spec.rpartition(":")
        module_name = f"finetune_tool_{abs(hash(path))}"
        if module_name not in sys.modules:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
            sys.modules[module_name] = module
        cache[spec] = getattr(sys.modules[module_name], name)
    return cache[spec]


def _answer(request: dict, cache: dict) -> dict:
    try:
        if "load" in request:
            _function(request["load"], cache)
            return {"ok": True}
        value = _function(request["call"], cache)(**request["arguments"])
    except BaseException as e:  # noqa: BLE001  (any failure of the user's tool is the model's to read)
        return {"error": f"{type(e).__name__}: {e}"}
    if isinstance(value, str):
        return {"text": value}
    return {"text": as_text(value), "non_text": True}


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    """Serve requests until stdin ends."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the tools' prints go to stderr, never into an answer
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cache: dict = {}
    for line in sys.stdin:
        answers.write(json.dumps(_answer(json.loads(line), cache)) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
