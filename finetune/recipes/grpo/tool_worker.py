"""The processes a rank's tools and environments run in, so that a call past ``train.grpo.tool_timeout_s`` can be
stopped: the rank kills the process and the next call starts another. A thread cannot be stopped, and one running C
code that holds the GIL (a huge ``**``) blocks the rank's own thread, its timeout and its signal handlers with it
(a preemption's SIGTERM could not checkpoint). Each rank runs this script twice: one process for its
``train.grpo.tools`` functions (:class:`finetune.recipes.grpo.tools.ToolProcess`) and one holding its
``train.grpo.environment`` instances (:class:`finetune.recipes.grpo.tools.RemoteEnvironment`), so that a tool that hangs
never takes the environments' state with it.

Run as a script (``python tool_worker.py``; standard library only, so it starts without the training stack). It
reads one JSON request a line on stdin and answers each with one JSON line on the stdout it started with (the
user's prints go to stderr). JSON only, both ways: nothing either side reads can run code.

* ``{"load": "/abs/file.py:name"}``: import the file (once) and find the function or factory -> ``{"ok": true}``
  or ``{"error": "..."}``;
* ``{"call": "/abs/file.py:name", "arguments": {...}}``: a tool call -> ``{"text": ...}`` (a string result),
  ``{"text": ..., "non_text": true}`` (another result, as :func:`as_text` writes it) or ``{"error": "Type: ..."}``;
* ``{"create": "/abs/file.py:Factory", "id": k, "row": {...}}``: a new environment instance (TRL 1.16's
  ``environment_factory``: ``Factory()``, then ``reset(**row)``), kept as ``k`` -> ``{"class": name, "methods":
  [...], "observation": None or text}`` (``"observation_type": name`` instead when ``reset`` returned something
  else; ``methods``: the instance's callable attributes, found without reading properties) or ``{"error": ...,
  "stage": "factory" | "reset"}``;
* ``{"invoke": name, "id": k, "args": [...], "kwargs": {...}, "text": bool}``: call a method of instance ``k`` ->
  with ``text``, a tool call's answers; else ``{"value": JSON}``, ``{"not_json": type name}``, ``{"missing": why}``
  (no such attribute) or ``{"error": ...}``;
* ``{"get": name, "id": k}``: read an attribute -> ``{"value": JSON}``, ``{"callable": true}``, ``{"not_json": type
  name}``, ``{"missing": why}`` or ``{"error": ...}``;
* ``{"drop_below": k}``: forget the instances numbered below ``k`` -> ``{"ok": true}``.

It exits at the end of stdin, and when the rank that started it is gone (its parent process changes).
"""

from __future__ import annotations

import importlib.util
import inspect
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


def _text(value) -> dict:
    """A tool call's answer for its result."""
    if isinstance(value, str):
        return {"text": value}
    return {"text": as_text(value), "non_text": True}


def _value(value) -> dict:
    """A value read by the rank: itself when JSON can carry it; a NumPy or PyTorch scalar (``.item()``) as the
    Python number it holds; else only its type's name."""
    try:
        json.dumps(value)
        return {"value": value}
    except (TypeError, ValueError, RecursionError):
        pass
    item = getattr(value, "item", None)
    if callable(item):
        try:
            plain = item()
        except Exception:  # noqa: BLE001  (an .item() that takes arguments, or a tensor of many values)
            plain = value
        if plain is None or isinstance(plain, (bool, int, float, str)):
            return {"value": plain}
    return {"not_json": type(value).__name__}


def _methods(instance) -> list[str]:
    """The instance's callable attributes (dunder names left out), found without reading a property."""
    out = []
    for name in dir(instance):
        if name.startswith("__") and name.endswith("__"):
            continue
        try:
            static = inspect.getattr_static(instance, name)
        except AttributeError:
            continue
        if callable(static) or isinstance(static, (staticmethod, classmethod)):
            out.append(name)
    return out


def _create(request: dict, cache: dict, instances: dict) -> dict:
    factory = _function(request["create"], cache)
    try:
        instance = factory()
    except BaseException as e:  # noqa: BLE001  (the user's factory)
        return {"error": f"{type(e).__name__}: {e}", "stage": "factory"}
    name = type(instance).__name__
    try:
        observation = instance.reset(**request["row"])
    except BaseException as e:  # noqa: BLE001  (the user's reset)
        return {"error": f"{type(e).__name__}: {e}", "stage": "reset", "class": name}
    instances[request["id"]] = instance
    answer = {"class": name, "methods": _methods(instance)}
    if observation is None or isinstance(observation, str):
        return {**answer, "observation": observation}
    return {**answer, "observation_type": type(observation).__name__}


def _answer(request: dict, cache: dict, instances: dict) -> dict:
    try:
        if "load" in request:
            _function(request["load"], cache)
            return {"ok": True}
        if "create" in request:
            return _create(request, cache, instances)
        if "drop_below" in request:
            for k in [k for k in instances if k < request["drop_below"]]:
                del instances[k]
            return {"ok": True}
        if "get" in request or "invoke" in request:
            name = request.get("get", request.get("invoke"))
            try:
                attribute = getattr(instances[request["id"]], name)
            except AttributeError as e:
                return {"missing": str(e)}
            if "get" in request:
                return {"callable": True} if callable(attribute) else _value(attribute)
            value = attribute(*request.get("args", []), **request.get("kwargs", {}))
            return _text(value) if request.get("text") else _value(value)
        value = _function(request["call"], cache)(**request["arguments"])
    except BaseException as e:  # noqa: BLE001  (any failure of the user's tool is the model's to read)
        return {"error": f"{type(e).__name__}: {e}"}
    return _text(value)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    """Serve requests until stdin ends."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the user's prints go to stderr, never into an answer
    sys.stdout = sys.stderr
    # run as a script, Python put this file's folder (finetune/recipes/grpo) first on sys.path, where a user's
    # `import tools` or `import rewards` would find finetune's modules instead of theirs (finetune/run.py does
    # the same for the rank)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cache: dict = {}
    instances: dict = {}
    for line in sys.stdin:
        answers.write(json.dumps(_answer(json.loads(line), cache, instances)) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
