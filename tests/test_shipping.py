"""Unit tests: which names a cell needs, serialization by value, change detection."""

import threading

import pytest
import torch

from jupyter_scale import shipping
from jupyter_scale.errors import ShippingError


@pytest.mark.parametrize(
    "source, expected",
    [
        ("y = x + 1", ["x"]),
        ("x = 1\ny = x", []),
        ("x = x + 1", ["x"]),  # read before written
        ("x += 1", ["x"]),
        ("for a, b in loader:\n    print(a, b, model)", ["loader", "print", "model"]),
        ("if flag:\n    z = 1\nprint(z)", ["flag", "print", "z"]),  # maybe-unbound: ship if present
        ("import torch\ntorch.zeros(1)", []),
        ("from torch import nn\nnn.Linear", []),
        ("def f(a):\n    return a + w\nf(1)", ["w"]),  # read inside a function at call time
        ("def f():\n    return w\nw = 2\nf()", []),  # ...of a name the cell itself binds
        ("g = lambda t: t * scale", ["scale"]),
        ("vals = [v * k for v in items]", ["items", "k"]),
        ("d = {k: v for k, v in pairs.items() if k in keep}", ["pairs", "keep"]),
        ("class A(Base):\n    n = size\n", ["Base", "size"]),
        ("try:\n    r = risky()\nexcept Err as e:\n    print(e)", ["risky", "Err", "print"]),
        ("with ctx() as c:\n    c.run(data)", ["ctx", "data"]),
        ("del old", ["old"]),
        ("(n := count) and n", ["count"]),
    ],
)
def test_free_names(source, expected):
    assert shipping.free_names(source) == expected


def roundtrip(value):
    payload = shipping.dumps(value)
    # The transport may hand buffers back as read-only bytes.
    return shipping.loads(payload.stream, [bytes(b) for b in payload.buffers])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_tensor_roundtrip_by_buffer(dtype):
    t = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
    payload = shipping.dumps(t)
    assert payload.buffers and payload.buffers[0].nbytes == t.numel() * t.element_size()
    back = roundtrip(t)
    assert back.dtype == dtype and torch.equal(back, t)
    back.view(-1)[0] = 1  # owned, writable memory
    assert t.view(-1)[0] != 1 or dtype == torch.bool


def test_views_send_only_their_elements_and_keep_values():
    base = torch.arange(1000.0)
    view = base[10:20]
    payload = shipping.dumps(view)
    assert sum(b.nbytes for b in payload.buffers) == 10 * 4
    assert torch.equal(roundtrip(view), view)
    strided = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(roundtrip(strided), strided)
    assert roundtrip(torch.zeros(0, 5)).shape == (0, 5)


def test_parameters_and_notebook_classes_travel_by_value():
    class Local(torch.nn.Module):  # defined here, not importable by the receiver
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

    m = Local()
    back = roundtrip(m)
    assert type(back).__name__ == "Local"
    assert isinstance(back.lin.weight, torch.nn.Parameter) and back.lin.weight.requires_grad
    assert torch.equal(back.lin.weight, m.lin.weight)


def test_unserializable_value_names_the_variable():
    with pytest.raises(ShippingError) as info:
        shipping.dumps_named({"ok": 1, "lock": threading.Lock()})
    assert info.value.name == "lock"
    assert "'lock'" in str(info.value) and "lock" in str(info.value.cause)


def fingerprint(value):
    return shipping.fingerprint(value, shipping.dumps(value))


def test_fingerprint_tracks_changes_without_hashing_tensors():
    t = torch.zeros(1000)
    first = fingerprint(t)
    assert fingerprint(t) == first
    t.add_(1)  # in-place: torch bumps the version counter
    assert fingerprint(t) != first
    m = torch.nn.Linear(4, 4)
    before = fingerprint(m)
    assert fingerprint(m) == before
    with torch.no_grad():
        m.weight[0, 0] = 5.0
    assert fingerprint(m) != before
    m2 = fingerprint(m)
    m.extra = "attribute"  # non-tensor state is part of the hashed stream
    assert fingerprint(m) != m2


def test_fingerprint_of_plain_values_is_by_content():
    values = [1, 2, 3]
    first = fingerprint(values)
    values.append(4)
    assert fingerprint(values) != first
    import numpy as np

    a = np.zeros(100)
    fa = fingerprint(a)
    a[3] = 1  # numpy has no version counter: its bytes are hashed
    assert fingerprint(a) != fa
