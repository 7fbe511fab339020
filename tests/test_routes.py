"""meshcomm.group.routes: one place names an array's kind and route (issue 34 item 3).

The GPU kinds need a GPU and cupy (tests/test_gpu.py, tests/test_nccl*.py); here: every kind
a CPU machine holds, and the rules that decide a GPU array's way without one.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshcomm.backends.local import SelfCommunicator
from meshcomm.group import routes


def test_host_kinds_and_their_route() -> None:
    x = np.arange(3.0)
    assert routes.kind_of(x) == "numpy"
    assert routes.kind_of(np.float32(1)) == "other"
    assert routes.kind_of([1, 2]) == "other"
    assert routes.array_module(x) is np and routes.device_module(x) is None
    comm = SelfCommunicator()
    # Host arrays take the host route even where the group has a device communicator.
    assert routes.group_route(comm, x) == routes.HostRoute(x, None)
    assert routes.device_route(comm, x) is None
    assert routes.host_route([1]) == routes.HostRoute([1], None)
    assert routes.give_back(None, x) is x


def test_torch_kinds() -> None:
    torch = pytest.importorskip("torch")
    assert routes.kind_of(torch.zeros(2)) == "torch"
    assert routes.kind_of(torch.nn.Parameter(torch.zeros(2))) == "torch"
    assert routes.kind_of(torch.zeros(2, device="meta")) == "torch-other"

    class Mine(torch.Tensor):  # a subclass defined outside torch is a tensor too
        pass

    assert routes.kind_of(torch.zeros(2).as_subclass(Mine)) == "torch"
    assert routes.torch_kind(torch.zeros(1)) == "torch"


def test_jax_kinds() -> None:
    jax = pytest.importorskip("jax")
    x = jax.numpy.arange(3.0)
    assert routes.kind_of(x) == "jax"
    seen: list[str] = []

    def f(y: object) -> object:
        seen.append(routes.kind_of(y))
        return y

    jax.jit(f)(x)
    assert seen == ["jax-tracer"] and routes.is_jax_tracer(x) is False


@pytest.mark.parametrize(
    ("kind", "bf16", "device", "expected"),
    [
        ("cupy", False, object(), True),
        ("torch-cuda", False, object(), True),
        ("torch-cuda", True, object(), False),  # cupy has no bfloat16
        ("torch-cuda", False, None, False),  # no device communicator
        ("torch", False, object(), False),
        ("numpy", False, object(), False),
    ],
)
def test_which_gpu_arrays_stay_on_the_device(
    kind: str, bf16: bool, device: object, expected: bool
) -> None:
    assert routes.stays_on_device(kind, bf16, device) is expected


def test_host_kinds_never_go_through_cupy() -> None:
    for kind in ("numpy", "torch", "torch-other", "jax", "other"):
        assert routes.via_cupy(kind) is None
    assert routes.via_cupy("torch-cuda", bfloat16=True) is None
