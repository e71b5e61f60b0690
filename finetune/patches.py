"""Every change finetune makes to an object of another library at run time, in one place.

finetune changes five kinds of library objects, each only where the library offers no public way, each through a
:class:`Patch` that records the original, is applied with :func:`apply` (which checks that the target is there and,
where the change depends on the library's internals, that the version is one the change was checked against) and
is undone by :meth:`Patch.restore`:

* transformers' attention table (``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS``): DeepSpeed's Ulysses
  attention and the packed-row ``sdpa`` under sequence parallelism (:mod:`finetune.parallel.sequence`), ``sdpa``
  with dropout on CPU ranks (:func:`finetune.engine.kernels.lighten_attention_dropout`), and the self-test's
  reference attention;
* the ``forward`` of model instances: tiled MLPs (DeepSpeed's ``TiledMLP``, :mod:`finetune.parallel.sequence`);
* attributes that DeepSpeed's Ulysses forward overwrites on attention modules (``num_key_value_groups``):
  watched, not set, so that whole-sequence work can put them back;
* a private method of one DeepSpeed ZeRO-3 optimizer instance (the gradient average under sequence parallelism)
  and torch's default timeout for process groups created after ``init_process_group``;
* DeepSpeed's ``set_optimizer_flags`` during ``deepspeed.initialize`` with ``train.optimizer: muon`` (finetune's
  ``use_muon`` tags are kept, :mod:`finetune.engine.muon`).

Patches applied with :func:`apply` are *active* until restored: :func:`suspended` restores every model-scope
patch for a block and re-applies what was there on leaving (whole-sequence work under sequence parallelism: the
export check, text generation), :func:`restore_all` undoes them all (the end of a run, tests), and
:func:`active` lists them with their original and current values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from finetune.errors import RunFailure

__all__ = ["Patch", "apply", "active", "suspended", "restore_all", "applied", "require_version", "instance_forward",
           "attention_function", "watch_attribute", "instance_method", "module_global"]

_MISSING = object()


@dataclass(eq=False)
class Patch:
    """One change of one library object: ``target[key]`` (``item=True``) or ``target.key`` set to ``value``.

    ``value=None`` with ``watch=True`` changes nothing on :meth:`set`: the library itself changes the attribute
    later, and the patch only remembers the original so that :meth:`restore` can put it back.
    """

    target: Any
    """The object changed (a module, a dict-like table, an instance)."""
    key: str
    """The attribute or item changed."""
    value: Any
    """What is put there."""
    why: str
    """Why finetune changes it, and the upstream issue it works around (or that none is filed)."""
    item: bool = False
    """True for ``target[key]``, False for ``target.key``."""
    watch: bool = False
    """True when the library changes the attribute and the patch only records and restores it."""
    scope: str = "model"
    """``"model"``: restored by :func:`suspended` (whole-sequence work); ``"process"``: only by :func:`restore_all`."""
    instance: bool = False
    """True when the attribute is set on an instance over its class's (``module.forward``): restore deletes the
    instance attribute when there was none."""
    original: Any = field(default=_MISSING, repr=False)
    """The value before :meth:`set` (``_MISSING`` for an instance attribute that did not exist)."""

    def describe(self) -> str:
        """``<type of target>.<key>`` or ``<target>[<key>]`` for messages."""
        name = getattr(self.target, "__name__", type(self.target).__name__)
        return f"{name}[{self.key!r}]" if self.item else f"{name}.{self.key}"

    def current(self) -> Any:
        """The value there now (``_MISSING`` for an absent instance attribute)."""
        if self.item:
            return self.target[self.key]
        if self.instance:
            return vars(self.target).get(self.key, _MISSING)
        return getattr(self.target, self.key, _MISSING)

    def _put(self, value: Any) -> None:
        if self.item:
            self.target[self.key] = value
        elif value is _MISSING:
            vars(self.target).pop(self.key, None)
        else:
            setattr(self.target, self.key, value)

    def set(self) -> None:
        """Record the original and put :attr:`value` there (nothing is put for a watched attribute).

        Raises:
            RunFailure: the target has no such attribute or item (the library changed: finetune would otherwise
                change nothing, or the wrong thing, without a word).
        """
        present = (self.key in self.target) if self.item else (hasattr(self.target, self.key))
        if not present:
            raise RunFailure(f"finetune patches {self.describe()}, which this version of the library does not have "
                             f"({self.why}); install the versions finetune pins (pyproject.toml)")
        self.original = self.current()
        if not self.watch:
            self._put(self.value)

    def restore(self) -> None:
        """Put the original back (no-op before :meth:`set`)."""
        if self.original is not _MISSING or self.instance:
            self._put(self.original)


_ACTIVE: list[Patch] = []


def apply(patch: Patch) -> Patch:
    """Set ``patch`` and keep it active until :func:`restore_all`; returns it.

    Raises:
        RunFailure: the patched attribute or item is missing (:meth:`Patch.set`).
    """
    patch.set()
    _ACTIVE.append(patch)
    return patch


def active() -> list[tuple[Patch, Any, Any]]:
    """Every active patch with its original and current value (tests check :func:`suspended` against it)."""
    return [(p, p.original, p.current()) for p in _ACTIVE]


@contextlib.contextmanager
def suspended(scope: str = "model") -> Iterator[None]:
    """Within the block every active patch of ``scope`` is undone (the libraries' own objects again); on leaving,
    each gets back what it held on entering (finetune's value, or what the library had set on a watched one)."""
    held = [(p, p.current()) for p in _ACTIVE if p.scope == scope]
    for p, _ in reversed(held):
        p.restore()
    try:
        yield
    finally:
        for p, value in held:
            p._put(value)


def restore_all(scope: str | None = None) -> None:
    """Undo every active patch (of ``scope`` only, when given), newest first, and forget them."""
    for p in [p for p in reversed(_ACTIVE) if scope in (None, p.scope)]:
        p.restore()
        _ACTIVE.remove(p)


@contextlib.contextmanager
def applied(*patches: Patch) -> Iterator[None]:
    """The patches set for the block only (not registered as active), restored on leaving, newest first."""
    done = []
    try:
        for p in patches:
            p.set()
            done.append(p)
        yield
    finally:
        for p in reversed(done):
            p.restore()


def require_version(package: str, version: str, checked: tuple[str, ...], what: str) -> None:
    """Refuse a patch of ``package``'s internals on a version it was not checked against.

    Raises:
        RunFailure: ``version`` is not in ``checked``; the message names ``what`` and the versions that work.
    """
    if version not in checked:
        raise RunFailure(f"{what} is checked for {package} {', '.join(checked)} only (this is {version}); install "
                         f"{package}=={checked[-1]}")


def attention_function(name: str, fn: Callable, why: str) -> Patch:
    """A patch of transformers' attention table: ``ALL_ATTENTION_FUNCTIONS[name] = fn``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return Patch(ALL_ATTENTION_FUNCTIONS, name, fn, why, item=True)


def mask_function(name: str, fn: Callable, why: str) -> Patch:
    """A patch of transformers' attention-mask table: ``ALL_MASK_ATTENTION_FUNCTIONS[name] = fn``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return Patch(ALL_MASK_ATTENTION_FUNCTIONS, name, fn, why, item=True)


def instance_forward(module, forward: Callable, why: str) -> Patch:
    """A patch of one module instance's ``forward`` (the class is untouched)."""
    return Patch(module, "forward", forward, why, instance=True)


def watch_attribute(obj, name: str, why: str) -> Patch:
    """A record of ``obj.name`` that a library overwrites later, to put it back in :func:`suspended`."""
    return Patch(obj, name, None, why, watch=True)


def instance_method(obj, name: str, wrap: Callable[[Callable], Callable], why: str) -> Patch:
    """A patch of one instance's (bound) method: ``obj.name = wrap(obj.name)``.

    Raises:
        RunFailure: ``obj`` has no callable ``name``.
    """
    method = getattr(obj, name, None)
    if not callable(method):
        raise RunFailure(f"finetune patches {type(obj).__name__}.{name}, which this version of the library does not "
                         f"have ({why}); install the versions finetune pins (pyproject.toml)")
    return Patch(obj, name, wrap(method), why, instance=True, scope="process")


def module_global(module, name: str, value: Any, why: str) -> Patch:
    """A patch of a module-level global of a library, for the whole process."""
    return Patch(module, name, value, why, scope="process")
