"""The native NCCL binding (:mod:`meshcomm.backends.nccl._native`) without a GPU.

The real libnccl loads and answers on a machine without a GPU (version, error strings,
unique ids; a communicator's init fails for want of CUDA), so CI checks the binding against
the library the ``nvidia-nccl-cu13`` wheel installs, and checks every bound call's arity and
argument sizes and the config struct's layout against that wheel's ``nccl.h``, compiled
here with stand-in CUDA headers. The GPU half (init, collectives and split through it) is
in tests/test_nccl.py and tests/test_nccl_groups.py. Also here: a group's split agrees on
the device communicators' collective split, on real tcp worlds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meshcomm.backends.nccl import _native
from meshcomm.backends.nccl.communicator import NATIVE_VARIABLE, native_requested
from meshcomm.group import ProcessGroup
from meshcomm.testing import run_ranks


def _library() -> tuple[_native.Library | None, str]:
    try:
        return _native.load_library(), ""
    except ImportError as exc:
        return None, f"no libnccl to bind (pip install nvidia-nccl-cu13): {exc}"


LIB, NO_LIB = _library()
needs_lib = pytest.mark.skipif(LIB is None, reason=NO_LIB or "ok")


def _header() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        found = Path(root) / "nccl" / "include" / "nccl.h"
        if found.is_file():
            return found
    return None


def _has_gpu() -> bool:
    return Path("/dev/nvidiactl").exists()


# == the library ============================================================================
@needs_lib
def test_the_library_reports_a_version_the_binding_takes() -> None:
    assert LIB is not None
    assert LIB.version >= _native.OLDEST


@needs_lib
def test_unique_ids_are_128_fresh_bytes() -> None:
    assert LIB is not None
    first, second = LIB.unique_id(), LIB.unique_id()
    assert len(first) == len(second) == 128
    assert first != second


@needs_lib
def test_an_error_code_reads_as_nccls_name_and_words() -> None:
    assert LIB is not None
    with pytest.raises(_native.NcclFailure, match=r"^ncclCommSplit: ncclInvalidArgument \(4\): ."):
        LIB.check(4, "ncclCommSplit")
    LIB.check(0, "ncclCommSplit")  # success raises nothing


@needs_lib
@pytest.mark.skipif(_has_gpu(), reason="this host has a GPU: init would succeed")
def test_init_without_a_gpu_is_an_nccl_failure_naming_cuda() -> None:
    assert LIB is not None
    with pytest.raises(
        _native.NcclFailure, match=r"ncclCommInitRankConfig: ncclUnhandledCudaError"
    ):
        _native.NativeComm.init_rank(LIB, 1, LIB.unique_id(), 0, 5.0)


def test_a_missing_library_names_the_wheel_and_the_variable(monkeypatch: Any) -> None:
    monkeypatch.setattr(_native, "_LOADED", None)
    monkeypatch.setenv("MESHCOMM_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    with pytest.raises(ImportError, match=r"nvidia-nccl-cu12 .*MESHCOMM_NCCL_LIBRARY.*nonexistent"):
        _native.load_library()


def test_the_native_binding_is_off_unless_asked_for(monkeypatch: Any) -> None:
    monkeypatch.delenv(NATIVE_VARIABLE, raising=False)
    assert not native_requested()
    for word in ("1", "on", "TRUE", " yes "):
        monkeypatch.setenv(NATIVE_VARIABLE, word)
        assert native_requested()
    monkeypatch.setenv(NATIVE_VARIABLE, "0")
    assert not native_requested()


# == against nccl.h =========================================================================
_STAND_IN_CUDA = """
#define CUDART_VERSION 10000
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
"""
_PROGRAM = """
#include <cstddef>
#include <cstdio>
#include "nccl.h"
template <class F> struct Sig;
template <class R, class... A> struct Sig<R(A...)> {
  static void show(const char* name) {
    std::printf("%s %zu", name, sizeof(R));
    ((std::printf(" %zu", sizeof(A))), ...);
    std::printf("\\n");
  }
};
int main() {
FUNCTIONS
  std::printf("config %zu", sizeof(ncclConfig_t));
FIELDS
  std::printf("\\n");
}
"""


@pytest.fixture(scope="module")
def header_facts(tmp_path_factory: Any) -> dict[str, list[int]]:
    """What nccl.h says: each bound call's return and argument sizes, and the config's
    size followed by each of the binding's fields' offset and size."""
    header, compiler = _header(), shutil.which("g++")
    if header is None or compiler is None:
        pytest.skip("needs the nvidia-nccl wheel's nccl.h and g++")
    work = tmp_path_factory.mktemp("nccl_h")
    (work / "cuda_runtime.h").write_text(_STAND_IN_CUDA)
    (work / "cuda_fp16.h").write_text("")
    functions = "\n".join(f'  Sig<decltype({n})>::show("{n}");' for n in _native._SIGNATURES)
    fields = "\n".join(
        f'  std::printf(" %zu %zu", offsetof(ncclConfig_t, {name}), '
        f"sizeof(((ncclConfig_t*)0)->{name}));"
        for name, _ in _native.Config._fields_
    )
    source = work / "facts.cpp"
    source.write_text(_PROGRAM.replace("FUNCTIONS", functions).replace("FIELDS", fields))
    binary = work / "facts"
    subprocess.run(
        [compiler, "-std=c++17", f"-I{work}", f"-I{header.parent}", str(source), "-o", str(binary)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=30)
    facts = {}
    for line in out.stdout.splitlines():
        name, *numbers = line.split()
        facts[name] = [int(n) for n in numbers]
    return facts


def test_every_bound_call_has_the_headers_arity_and_argument_sizes(
    header_facts: dict[str, list[int]],
) -> None:
    for name, argtypes in _native._SIGNATURES.items():
        result, *arguments = header_facts[name]
        assert result == ctypes.sizeof(ctypes.c_int), name
        assert arguments == [ctypes.sizeof(t) for t in argtypes], name


def test_the_config_prefix_has_the_headers_layout(header_facts: dict[str, list[int]]) -> None:
    size, *pairs = header_facts["config"]
    assert size >= ctypes.sizeof(_native.Config)  # NCCL appends; it defaults what we omit
    for k, (name, kind) in enumerate(_native.Config._fields_):
        field = getattr(_native.Config, name)
        assert (pairs[2 * k], pairs[2 * k + 1]) == (field.offset, ctypes.sizeof(kind)), name


# == a group's split, on real tcp worlds ====================================================
def _split_agreement(group: ProcessGroup, refuser: int) -> list[Any]:
    """Give the world a device communicator (a tcp one over the same ranks stands in) whose
    collective split is recorded; split the world in two; report what each rank saw."""
    device = group._comm.sub(list(range(group.size)))
    calls: list[Any] = []

    def split_sub(members: Any) -> Any:
        calls.append(None if members is None else list(members))
        return None if members is None else device.sub(members)

    device.can_split = lambda: group.rank != refuser  # type: ignore[method-assign]
    device.split_sub = split_sub  # type: ignore[method-assign]
    world = ProcessGroup(group._comm, store=group.store, name="agree", device=device)
    color = None if group.rank == 0 and group.size > 1 else group.rank % 2
    child = world.split(color, key=-group.rank)  # reversed order within each colour
    made = None
    if child is not None:
        assert child._device is not None
        made = list(child._device.global_ranks)
        # the host and device communicators have the same members in the same order
        assert made == list(child.ranks)
    return [calls, made, None if child is None else list(child.ranks)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_a_groups_split_splits_its_device_communicator_where_every_rank_can(world: int) -> None:
    results = run_ranks(_split_agreement, world, args=(-1,))
    for rank, (calls, made, ranks) in enumerate(results):
        if rank == 0 and world > 1:
            assert calls == [None] and made is None and ranks is None
            continue
        want = sorted(
            (r for r in range(world) if r % 2 == rank % 2 and (r or world == 1)), reverse=True
        )
        assert ranks == want and made == want
        assert calls == [want]


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_that_cannot_split_keeps_every_device_communicator_lazy(world: int) -> None:
    results = run_ranks(_split_agreement, world, args=(world - 1,))
    for rank, (calls, made, ranks) in enumerate(results):
        assert calls == []  # nobody split: one rank could not
        assert made == ranks  # each member's device communicator made lazily, same members
        if rank:
            assert ranks is not None and rank in ranks


# == meshcomm-info ==========================================================================
def test_meshcomm_info_reports_the_native_binding(monkeypatch: Any) -> None:
    from meshcomm.info import _backend_line, _native_binding

    monkeypatch.delenv(NATIVE_VARIABLE, raising=False)
    found = _native_binding()
    assert found["requested"] is False
    if LIB is not None:
        assert found["version"] == LIB.version and found["library"] == LIB.path
    facts = {"available": True, "cupy": "14.2.0", "nccl": 22809, "native": found}
    line = _backend_line("nccl", facts)
    assert "native binding off (MESHCOMM_NCCL_NATIVE=1 turns it on)" in line
    monkeypatch.setenv(NATIVE_VARIABLE, "1")
    facts["native"] = {"requested": True, "reason": "no libnccl.so.2"}
    assert _backend_line("nccl", facts).endswith(
        "native binding on, libnccl unusable: no libnccl.so.2"
    )
