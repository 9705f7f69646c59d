"""The seed contract's core types: keys, specs, results, job metadata and errors."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tiering
from tiering.core import specs
from tiering.core.contract import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiering.core.errors import (
    BlockNotFound,
    ConfigError,
    ContractError,
    CorruptBlock,
    PartialBatchError,
    TieringError,
)
from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import NO_CONTEXT, ReqContext, make_offload_key, split_offload_key
from tiering.core.specs import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    as_block_ids,
    trusted_block_ids,
)

# -- keys -------------------------------------------------------------------------------------


@given(block_hash=st.binary(min_size=1, max_size=64), group_idx=st.integers(0, 2**32 - 1))
def test_offload_key_round_trips(block_hash: bytes, group_idx: int) -> None:
    key = make_offload_key(block_hash, group_idx)
    assert isinstance(key, bytes) and len(key) == len(block_hash) + 4
    assert split_offload_key(key) == (block_hash, group_idx)


def test_offload_key_layout_is_hash_then_big_endian_group() -> None:
    assert make_offload_key(b"\xab\xcd", 258) == b"\xab\xcd\x00\x00\x01\x02"
    assert make_offload_key(bytearray(b"h"), np.int16(3)) == b"h\x00\x00\x00\x03"
    assert make_offload_key(memoryview(b"h"), 0) == b"h\x00\x00\x00\x00"


@pytest.mark.parametrize(
    ("block_hash", "group_idx", "error", "match"),
    [
        ("abc", 0, TypeError, "block_hash must be bytes"),
        (b"", 0, ValueError, "must not be empty"),
        (b"h", -1, ValueError, r"\[0, 2\*\*32\)"),
        (b"h", 2**32, ValueError, r"\[0, 2\*\*32\)"),
        (b"h", 1.0, TypeError, "group_idx must be an int"),
        (b"h", True, TypeError, "group_idx must be an int"),
    ],
)
def test_offload_key_rejects_bad_input(
    block_hash: object, group_idx: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make_offload_key(block_hash, group_idx)  # type: ignore[arg-type]


def test_split_rejects_short_keys() -> None:
    with pytest.raises(ValueError, match="not an offload key"):
        split_offload_key(b"\x00\x00\x00\x01")  # type: ignore[arg-type]


def test_req_context_is_immutable_and_defaults_to_nothing() -> None:
    assert ReqContext() == NO_CONTEXT and NO_CONTEXT.req_id is None
    ctx = ReqContext("r1", {"namespace": "a"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.req_id = "r2"  # type: ignore[misc]


# -- specs ------------------------------------------------------------------------------------


def test_block_ids_are_frozen_int64_copies() -> None:
    source = np.array([3, 1, 2], dtype=np.int32)
    spec = CPULoadStoreSpec(source)
    source[0] = 99
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.tolist() == [3, 1, 2]
    assert not spec.block_ids.flags.writeable
    assert len(spec) == 3 and CPULoadStoreSpec.medium() == "CPU"
    assert repr(spec) == "CPULoadStoreSpec([3, 1, 2])"
    assert len(CPULoadStoreSpec([])) == 0


@pytest.mark.parametrize(
    ("block_ids", "error", "match"),
    [
        ([[1, 2]], ValueError, "one-dimensional"),
        ([1, -2], ValueError, "non-negative"),
        ([1.5], TypeError, "must be integers"),
        ([True, False], TypeError, "must be integers"),
        (["1"], TypeError, "must be integers"),
        (
            [2**70],
            ValueError,
            "must fit in a signed 64-bit integer, got 1180591620717411303424",
        ),  # > int64
        ((1, 2**70), ValueError, "must fit in a signed 64-bit integer"),
        ([1, 2**63], ValueError, "must fit in a signed 64-bit integer"),  # numpy: float64
        ([2**63], ValueError, "must fit in a signed 64-bit integer"),  # numpy: uint64
        ([*range(70), 2**63], ValueError, "must fit in a signed 64-bit integer"),
        ([3, -(2**64)], ValueError, "non-negative, got -18446744073709551616"),
        (np.array([2**63], dtype=np.uint64), ValueError, "must fit in a signed 64-bit integer"),
        (np.array([3, -1], dtype=np.int64), ValueError, "non-negative"),
        (np.array([[1]], dtype=np.int64), ValueError, "one-dimensional"),
    ],
)
def test_block_ids_validation(block_ids: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        as_block_ids(block_ids)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [3, 200])  # the small-input fast paths and the general one
def test_block_ids_are_a_frozen_copy_of_the_input(size: int) -> None:
    source = np.arange(size, dtype=np.int64)
    for form in (source, source.tolist(), tuple(source.tolist())):
        ids = as_block_ids(form)
        assert ids.dtype == np.int64 and ids.tolist() == list(range(size))
        assert not ids.flags.writeable and as_block_ids(ids) is ids
    ids = as_block_ids(source)
    source[0] = 99  # the caller's array changes later: the validated ids do not
    assert ids[0] == 0


def test_validated_block_ids_pass_through_and_anything_else_is_checked() -> None:
    ids = as_block_ids([3, 1, 2])
    assert as_block_ids(ids) is ids  # a spec's ids handed to a job: no copy, no re-check
    copy = np.array([3, 1, 2], dtype=np.int64)
    copy.flags.writeable = False
    assert as_block_ids(copy) is not copy  # read-only, but not validated here
    with pytest.raises(ValueError, match="WRITEABLE"):
        ids.flags.writeable = True  # so what was validated stays valid


def test_rows_a_tier_owns_are_frozen_and_pass_through_unchecked_again() -> None:
    spec = CPULoadStoreSpec.of_own_rows([4, 0, 7])
    assert type(spec) is CPULoadStoreSpec and spec.medium() == "CPU" and len(spec) == 3
    ids = spec.block_ids
    assert ids.dtype == np.int64 and ids.tolist() == [4, 0, 7]
    assert as_block_ids(ids) is ids  # into a job as it is
    with pytest.raises(ValueError, match="WRITEABLE"):
        ids.flags.writeable = True
    assert trusted_block_ids([]).tolist() == []


def test_the_validated_registry_forgets_dead_arrays_and_never_matches_another() -> None:
    before = len(specs._VALIDATED)
    for i in range(5000):  # each dies at once: the prunes keep the registry bounded
        as_block_ids([i])
    assert len(specs._VALIDATED) < max(1024, 2 * before + 2)
    other = as_block_ids([0])  # validated and alive
    stranger = np.array([-1], dtype=np.int64)  # read-only but never validated
    stranger.flags.writeable = False
    specs._VALIDATED[id(stranger)] = weakref.ref(other)  # an entry under its id: not it
    with pytest.raises(ValueError, match="non-negative"):
        as_block_ids(stranger)


def test_gpu_spec_groups_and_indices() -> None:
    spec = GPULoadStoreSpec([10, 11, 20, 21, 22], group_sizes=[2, 3], block_indices=[4, 6])
    assert GPULoadStoreSpec.medium() == "GPU"
    assert spec.group_sizes == (2, 3) and spec.block_indices == (4, 6)
    assert [g.tolist() for g in spec.groups()] == [[10, 11], [20, 21, 22]]
    single = GPULoadStoreSpec([5, 6], block_indices=[0])
    assert single.group_sizes is None and [g.tolist() for g in single.groups()] == [[5, 6]]
    empty_group = GPULoadStoreSpec([7], group_sizes=[0, 1])
    assert [g.tolist() for g in empty_group.groups()] == [[], [7]]


@pytest.mark.parametrize(
    ("group_sizes", "block_indices", "match"),
    [
        ([2, 2], None, r"sum\(group_sizes\)=4 must equal len\(block_ids\)=3"),
        ([4, -1], None, "group_sizes must be non-negative"),
        ([1, 2], [0], r"len\(block_indices\)=1 must equal the number of KV cache groups \(2\)"),
        (None, [0, 1], r"number of KV cache groups \(1\)"),
        ([1, 2], [0, -3], "block_indices must be non-negative"),
    ],
)
def test_gpu_spec_validation(
    group_sizes: list[int] | None, block_indices: list[int] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        GPULoadStoreSpec([1, 2, 3], group_sizes=group_sizes, block_indices=block_indices)


# -- results and jobs -------------------------------------------------------------------------


def test_prepare_store_output_and_event_are_frozen() -> None:
    out = PrepareStoreOutput([b"k"], CPULoadStoreSpec([0]), [])  # type: ignore[list-item]
    event = OffloadingEvent([b"k"], 4096, "CPU", removed=False)  # type: ignore[list-item]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.keys_to_store = []  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.removed = True  # type: ignore[misc]


def test_job_metadata_freezes_and_validates() -> None:
    keys = [make_offload_key(b"a", 0), make_offload_key(b"b", 0)]
    job = JobMetadata(7, keys, [4, 5], is_promotion=True)  # type: ignore[arg-type]
    assert job.keys == tuple(keys) and job.block_ids.tolist() == [4, 5]
    assert not job.block_ids.flags.writeable
    assert job.req_context == ReqContext()
    keys.append(make_offload_key(b"c", 0))
    assert len(job.keys) == 2  # a copy, not the caller's list
    with pytest.raises(ValueError, match="job 7: 2 keys but 1 block_ids"):
        JobMetadata(7, tuple(keys[:2]), [4], is_promotion=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job_id must be a non-negative int"):
        JobMetadata(-1, (), [], is_promotion=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job_id"):
        JobMetadata("3", (), [], is_promotion=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is_promotion must be a bool"):
        JobMetadata(1, (), [], is_promotion=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        JobMetadata(1, tuple(keys[:1]), [-4], is_promotion=False)


def test_job_result_defaults_keep_the_seed_shape() -> None:
    result = JobResult(3, False)
    assert (result.job_id, result.success, result.successful_keys, result.error) == (
        3,
        False,
        None,
        None,
    )


# -- contract and errors ----------------------------------------------------------------------


def test_offloading_manager_requires_the_core_methods() -> None:
    with pytest.raises(TypeError, match="abstract"):
        OffloadingManager()  # type: ignore[abstract]
    assert {"lookup", "prepare_load", "prepare_store"} <= OffloadingManager.__abstractmethods__


def test_error_hierarchy_and_messages() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(ContractError, ValueError)
    for cls in (ConfigError, ContractError, BlockNotFound, CorruptBlock, PartialBatchError):
        assert issubclass(cls, TieringError)
    assert str(BlockNotFound(b"\x01\x02")) == "block 0102 is not in this tier"
    corrupt = CorruptBlock(b"\xff", "checksum mismatch")
    assert str(corrupt) == "block ff is corrupt: checksum mismatch"
    partial = PartialBatchError([b"a"], {b"b": OSError("disk")})
    assert partial.succeeded == frozenset({b"a"}) and set(partial.errors) == {b"b"}
    assert "1 of 2 block operations failed" in str(partial) and "disk" in str(partial)


def test_package_exports_the_contract_without_torch() -> None:
    for name in tiering.__all__:
        assert hasattr(tiering, name), name


@given(st.lists(st.integers(min_value=-(2**65), max_value=2**65), max_size=80))
def test_block_ids_of_any_int_list_are_those_ints_or_an_error(values: list[int]) -> None:
    """The small-input fast paths answer as the general path does, on either side of 64 ids."""
    if any(v < 0 or v >= 2**63 for v in values):
        # Named as what it is: negative, or beyond int64 (never "not integers", never wrapped).
        for form in (values, tuple(values)):
            with pytest.raises(ValueError, match=r"non-negative|fit in a signed 64-bit integer"):
                as_block_ids(form)
        return
    for form in (values, tuple(values), np.array(values, dtype=np.int64)):
        assert as_block_ids(form).tolist() == values


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CPULoadStoreSpec([1, True]), "got a bool"),
        (lambda: GPULoadStoreSpec([7, 8], group_sizes=[1.5, 1.5]), "group_sizes must be integers"),
        (lambda: GPULoadStoreSpec([7, 8], group_sizes=["1", "1"]), "group_sizes must be integers"),
        (lambda: GPULoadStoreSpec([7], block_indices=[2.9]), "block_indices must be integers"),
        (lambda: GPULoadStoreSpec([7], block_indices=[True]), "block_indices must be integers"),
    ],
)
def test_values_that_are_not_integers_are_refused_not_truncated(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        build()


def test_numpy_integers_are_integers() -> None:
    spec = GPULoadStoreSpec([7, 8], group_sizes=[np.int64(1), np.int32(1)], block_indices=[0, 3])
    assert spec.group_sizes == (1, 1) and spec.block_indices == (0, 3)
