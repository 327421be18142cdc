"""WrappedBackend: an attention backend that wraps the one SGLang built and answers for it.

OasisKV replaces only some attention calls (sparse layers, the paired verify / draft-extend
passes); everything else SGLang asks of its backend (CUDA-graph hooks, ``verify_mask``,
metadata, attributes) must reach the backend SGLang built
(``layers/attention/base_attn_backend.py`` ``AttentionBackend``). The wrappers subclass
``AttentionBackend`` (SGLang checks the type) and delegate every member they do not define.
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

# members AttentionBackend defines that the wrappers override themselves (``forward`` and
# ``forward_mixed`` dispatch to the wrapper's forward_extend / forward_decode)
_OWN = {"forward", "forward_mixed", "forward_extend", "forward_decode", "init_forward_metadata", "support_triton",
        "needs_cpu_seq_lens"}


def delegate_base_members(cls):
    """Class decorator: every method and property ``AttentionBackend`` defines (CUDA-graph
    hooks, ``verify_mask``, ...) goes to ``self.inner`` instead of the base class's default, so
    a wrapper behaves as the backend it wraps; plain class attributes are read from the inner
    backend at construction. ``needs_cpu_seq_lens`` stays True: the wrappers use SGLang's host
    copy of the lengths."""
    for name, val in vars(AttentionBackend).items():
        if name.startswith("__") or name in _OWN or name in vars(cls):
            continue
        if isinstance(val, property):
            setattr(cls, name, property((lambda n: lambda self: getattr(self.inner, n))(name)))
        elif callable(val) or isinstance(val, (staticmethod, classmethod)):
            setattr(cls, name, (lambda n: lambda self, *a, **k: getattr(self.inner, n)(*a, **k))(name))
    return cls


def _copy_plain_attributes(wrapper, inner) -> None:
    for name, val in vars(AttentionBackend).items():
        if not name.startswith("__") and name not in _OWN and not callable(val) \
                and not isinstance(val, (property, staticmethod, classmethod)) and hasattr(inner, name):
            setattr(wrapper, name, getattr(inner, name))


@delegate_base_members
class WrappedBackend(AttentionBackend):
    """A backend that wraps the one SGLang built (``self.inner``) and answers for it: every
    member it does not define, and every ``AttentionBackend`` member (``delegate_base_members``),
    is the wrapped backend's; subclasses override ``forward_extend`` / ``forward_decode`` and
    the metadata hooks they need (calling the wrapped backend's first)."""

    def __init__(self, inner: AttentionBackend):
        super().__init__()
        self.inner = inner
        _copy_plain_attributes(self, inner)

    def __getattr__(self, name):  # everything else is the wrapped backend's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def init_forward_metadata(self, forward_batch):
        """Delegate: the wrapped backend still serves the passes the wrapper does not take."""
        return self.inner.init_forward_metadata(forward_batch)

    def support_triton(self):
        """Delegate to the wrapped backend."""
        return self.inner.support_triton()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Delegate."""
        return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Delegate."""
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
