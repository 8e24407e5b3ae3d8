"""The capture record: its shape rules, derived fields, and what the npz reader and writer accept."""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import re
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

from fixtures.attention_captures import small_capture
from harness.attention import capture as capture_io
from harness.attention.capture import Capture, check_shapes
from harness.attention.layout import AttentionLayout

pytestmark = pytest.mark.cpu

PREFILL = AttentionLayout(3, 4, 1, "prefill")  # Q 8 x KV 8
DENOISE = AttentionLayout(3, 4, 1, "denoise")  # Q 5 x KV 7

_UNPICKLED: list[str] = []


class _Tripwire:
    """Records its own unpickling: a capture file must never run a pickle."""

    def __setstate__(self, state: dict) -> None:
        _UNPICKLED.append("unpickled")


def _tensors(batch=1, q_len=3, kv_len=5, heads=2, kv_heads=2, dim=4, kv_batch=None, kv_dim=None):
    q = torch.zeros(batch, q_len, heads, dim)
    k = torch.zeros(kv_batch or batch, kv_len, kv_heads, kv_dim or dim)
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    return q, k, k.clone(), mask


def test_a_capture_needs_4d_float_arrays_that_agree_and_a_bool_mask_of_their_shape():
    for overrides, match in (
            ({"kv_batch": 2}, r"query \(1, 3, 2, 4\) and key \(2, 5, 2, 4\) must share batch and head dim"),
            ({"kv_dim": 8}, r"query \(1, 3, 2, 4\) and key \(1, 5, 2, 8\) must share batch and head dim"),
            ({"heads": 3, "kv_heads": 2}, "3 query heads are not a multiple of 2 key/value heads"),
            # an empty capture would pass every bound vacuously (and zero KV heads divide nothing)
            ({"q_len": 0}, r"query \(1, 0, 2, 4\) and key \(1, 5, 2, 4\) hold no attention to compare"),
            ({"kv_len": 0}, r"query \(1, 3, 2, 4\) and key \(1, 0, 2, 4\) hold no attention to compare"),
            ({"kv_heads": 0}, r"and key \(1, 5, 0, 4\) hold no attention to compare")):
        with pytest.raises(ValueError, match=match):
            Capture(*_tensors(**overrides), name="t")
    q, k, v, mask = _tensors()
    with pytest.raises(ValueError, match=r"capture t: query must be a \(B, S, H, D\) tensor, got torch.Size\(\[3, 2,"):
        Capture(q[0], k, v, mask, name="t")
    with pytest.raises(ValueError, match="capture t: key must be a .* tensor, got list"):
        Capture(q, [1.0], v, mask, name="t")
    with pytest.raises(ValueError, match=r"mask must be bool of shape \(B, 1, Q, KV\) = \(1, 1, 3, 5\), got "
                                         r"torch.float32 \(1, 1, 3, 5\)"):
        Capture(q, k, v, mask.float(), name="t")
    with pytest.raises(ValueError, match=r"= \(1, 1, 3, 5\), got torch.bool \(1, 1, 3, 4\)"):
        Capture(q, k, v, mask[..., :4], name="t")


def test_a_recorded_layout_is_held_to_integer_dtypes_its_shapes_and_its_keys_when_built():
    """The rules the npz reader applies hold for a capture built in memory (a recorder's) too."""
    q, k, v, mask = _tensors()  # Q 3, KV 5
    positions, spans = torch.tensor([[2, 3, 4]]), torch.tensor([[[0, 2]]])
    assert Capture(q, k, v, mask, name="t", positions=positions, spans=spans).recorded
    for bad_positions, bad_spans, error, match in (
            (positions.float(), spans, TypeError, "capture t: positions must be an integer tensor, got torch.float32"),
            (positions, spans == 1, TypeError, "capture t: spans must be an integer tensor, got torch.bool"),
            (positions[:, :2], spans, ValueError, r"positions must be \(B, Q\) = \(1, 3\), got \(1, 2\)"),
            (positions, spans[..., :1], ValueError, r"spans must be \(B, N, 2\)"),
            (positions + 1, spans, ValueError, r"positions\[0, 2\] = 5 is no key position of its 5 keys"),
            (positions, spans + 4, ValueError, r"spans\[0, 0\] = \[4, 6\) is no span of its 5 keys")):
        with pytest.raises(error, match=match):
            Capture(q, k, v, mask, name="t", positions=bad_positions, spans=bad_spans)


def test_a_recorded_layout_of_any_integer_width_loads_as_int64(tmp_path):
    q, k, v, mask = (t.numpy() for t in _tensors())
    path = tmp_path / "call0_rank0.npz"
    np.savez(path, query=q, key=k, value=v, mask=mask, positions=np.array([[2, 3, 4]], dtype=np.int32),
             spans=np.array([[[0, 2]]], dtype=np.int16))
    loaded = capture_io.load_capture(path)
    assert (loaded.positions.dtype, loaded.spans.dtype) == (torch.int64, torch.int64)
    assert loaded.positions.tolist() == [[2, 3, 4]] and loaded.spans.tolist() == [[[0, 2]]]


def test_a_synthetic_capture_holds_one_row_unless_asked_for_more():
    assert capture_io.synthetic_capture(PREFILL, seed=3).query.shape[0] == 1
    assert capture_io.synthetic_capture(PREFILL, seed=3, batch=2).query.shape[0] == 2


def test_derived_lengths_heads_phase_and_seed_call_names():
    got = {layout.phase: (c.q_len, c.kv_len, c.heads, c.kv_heads, c.phase, c.name)
           for layout in (PREFILL, DENOISE) for c in [small_capture(layout, heads=4, kv_heads=2)]}
    assert got == {"prefill": (8, 8, 4, 2, "prefill", "synthetic_call0_rank0.npz"),
                   "denoise": (5, 7, 4, 2, "denoise", "synthetic_call32_rank0.npz")}


def test_heads_first_and_select_heads_keep_gqa_groups():
    capture = small_capture(DENOISE, heads=4, kv_heads=2, head_dim=8, seed=1)
    q, k, v = capture.heads_first()
    assert [(tuple(t.shape), t.is_contiguous()) for t in (q, k, v)] == [((1, 4, 5, 8), True), ((1, 2, 7, 8), True),
                                                                         ((1, 2, 7, 8), True)]
    assert torch.equal(q, capture.query.transpose(1, 2)) and torch.equal(v, capture.value.transpose(1, 2))
    every = capture.select_heads(4)
    assert (every.heads, every.kv_heads, torch.equal(every.key, capture.key)) == (4, 2, True)
    two = capture.select_heads(2)
    assert (two.heads, two.kv_heads, torch.equal(two.query, capture.query[:, :, :2])) == (2, 1, True)
    for heads in (0, 3, 6):
        with pytest.raises(ValueError, match=f"cannot keep {heads} of 4 query heads .*GQA group 2"):
            capture.select_heads(heads)


def test_synthetic_captures_own_their_masks_and_are_named_for_the_seed_calls():
    for layout, batch, name in ((PREFILL, 1, "synthetic_call0_rank0.npz"), (DENOISE, 2, "synthetic_call32_rank0.npz")):
        first = capture_io.synthetic_capture(layout, heads=1, head_dim=4, batch=batch, seed=0)
        assert first.mask.is_contiguous() and first.mask.shape == (batch, 1, layout.q_len, layout.kv_len)
        assert first.name == name
        first.mask[:, :, 0, 0] = False  # a caller may edit its capture's mask (e.g. to plant a bug)
        again = capture_io.synthetic_capture(layout, heads=1, head_dim=4, batch=batch, seed=0)
        assert bool(again.mask[:, :, 0, 0].all()), layout.phase


class _DeviceTensor(torch.Tensor):
    """A tensor held off the CPU: like a CUDA tensor, it has to be copied to the CPU before numpy."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert a device tensor to numpy; use Tensor.cpu() to copy it to the host first")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


def test_saving_copies_device_tensors_to_the_host_in_c_order(tmp_path):
    source = small_capture(DENOISE, heads=2, head_dim=8, seed=4)
    # (B, S, H, D) views of tensors laid out the other way round, on a device
    views = {name: getattr(source, name).permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
             for name in capture_io.CAPTURE_ARRAYS}
    assert not views["query"].is_contiguous()
    device = Capture(*(t.as_subclass(_DeviceTensor) for t in views.values()), scale=source.scale, name="device")
    path = capture_io.save_capture(device, tmp_path / "call32_rank0.npz")
    with np.load(path) as z:
        orders = {name: np.isfortran(z[name]) for name in z.files}
    assert orders == dict.fromkeys(capture_io.CAPTURE_ARRAYS, False)  # the seed's dumps are C-order
    loaded = capture_io.load_capture(path)
    for name in capture_io.CAPTURE_ARRAYS:
        assert torch.equal(getattr(loaded, name), getattr(source, name)), name


def test_a_capture_file_of_empty_arrays_is_refused_from_its_headers():
    shapes = {"query": (1, 0, 2, 4), "key": (1, 5, 2, 4), "value": (1, 5, 2, 4), "mask": (1, 1, 0, 5)}
    with pytest.raises(ValueError, match=r"capture f.npz: query \(1, 0, 2, 4\) and key \(1, 5, 2, 4\) hold no "
                                         r"attention to compare"):
        check_shapes("f.npz", shapes)


def test_a_capture_file_whose_query_heads_do_not_group_over_its_kv_heads_is_refused_from_its_headers():
    shapes = {"query": (1, 3, 3, 4), "key": (1, 5, 2, 4), "value": (1, 5, 2, 4), "mask": (1, 1, 3, 5)}
    with pytest.raises(ValueError, match="capture f.npz: 3 query heads are not a multiple of 2 key/value heads"):
        check_shapes("f.npz", shapes)
    check_shapes("f.npz", dict(shapes, query=(1, 3, 4, 4)))  # 4 query heads share 2 kv heads in pairs


@pytest.mark.parametrize(("key", "differs"), [((2, 5, 2, 4), r"\(2, 5, 2, 4\)"), ((1, 5, 2, 8), r"\(1, 5, 2, 8\)")],
                         ids=["batch", "head_dim"])
def test_a_capture_file_whose_key_differs_from_its_query_in_batch_or_head_dim_alone_is_refused(key, differs):
    shapes = {"query": (1, 3, 2, 4), "key": key, "value": key, "mask": (1, 1, 3, 5)}
    with pytest.raises(ValueError, match=rf"capture f.npz: query \(1, 3, 2, 4\) and key {differs} must share batch "
                                         "and head dim"):
        check_shapes("f.npz", shapes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_capture_in_another_float_dtype_is_saved_as_float32(dtype, tmp_path):
    """The format holds float32 q/k/v: a bf16 run's capture (numpy has no bf16) or an fp64 one is written as
    float32, and reads back as the same values rounded to float32."""
    source = small_capture(PREFILL, heads=1, head_dim=4)
    cast = dataclasses.replace(source, query=source.query.to(dtype), key=source.key.to(dtype),
                               value=source.value.to(dtype))
    loaded = capture_io.load_capture(capture_io.save_capture(cast, tmp_path / "call0_rank0.npz"))
    for name in ("query", "key", "value"):
        assert torch.equal(getattr(loaded, name), getattr(cast, name).float()), name


def test_a_capture_taken_from_a_live_model_is_saved_as_its_values(tmp_path):
    """Tensors that still require grad (q/k/v hooked off a model outside no_grad) save like any others."""
    source = small_capture(PREFILL, heads=1, head_dim=4, seed=2)
    live = dataclasses.replace(source, **{name: getattr(source, name).clone().requires_grad_()
                                          for name in ("query", "key", "value")})
    loaded = capture_io.load_capture(capture_io.save_capture(live, tmp_path / "call0_rank0.npz"))
    for name in capture_io.CAPTURE_ARRAYS:
        assert torch.equal(getattr(loaded, name), getattr(source, name)), name


def _saved(tmp_path, name="call0_rank0.npz") -> bytes:
    return capture_io.save_capture(small_capture(PREFILL, heads=1, head_dim=4), tmp_path / name).read_bytes()


def test_a_zip_behind_other_data_is_not_an_npz_archive_to_either_reader(tmp_path):
    """zipfile finds an archive behind leading bytes, but np.load reads such a file as a pickle or a bare array:
    both readers refuse it up front, so validation passes nothing the loader would not read (and no pickle runs)."""
    archive = _saved(tmp_path)
    bare, objects = io.BytesIO(), io.BytesIO()
    np.save(bare, np.zeros(3, dtype=np.float32))
    np.save(objects, np.array([None, 1], dtype=object), allow_pickle=True)
    tripwire = _Tripwire()
    tripwire.armed = True  # a state to set: unpickling it calls __setstate__
    assert pickle.loads(pickle.dumps(tripwire)) and _UNPICKLED.pop() == "unpickled"
    for lead in (pickle.dumps(tripwire), bare.getvalue(), objects.getvalue()):
        path = tmp_path / "call1_rank0.npz"
        path.write_bytes(lead + archive)
        for read in (capture_io.validate_file, capture_io.load_capture):
            with pytest.raises(ValueError, match=rf"capture file {re.escape(str(path))}: not an npz archive \(other "
                                                 r"data precedes its zip records\)"):
                read(path)
    assert _UNPICKLED == []
    empty = tmp_path / "call2_rank0.npz"
    np.savez(empty)  # an archive of no arrays starts with the zip's end record: an npz, refused for what it lacks
    for read in (capture_io.validate_file, capture_io.load_capture):
        with pytest.raises(ValueError, match=r"call2_rank0.npz: missing arrays \['query', 'key', 'value', 'mask'\]"):
            read(empty)


def _short_member(archive: bytes, member: bytes, short_by: int) -> bytes:
    """``archive`` whose central directory gives ``member`` ``short_by`` fewer stored bytes (and their CRC) but
    keeps its declared size: zipfile then reads a short member without complaint."""
    data = bytearray(archive)
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        info = zf.getinfo(member.decode())
        kept = zf.read(info)[:-short_by]
    assert info.compress_type == zipfile.ZIP_STORED  # np.savez stores its members
    entry = data.index(b"PK\x01\x02")  # the central directory's entries
    while data[entry + 46:entry + 46 + len(member)] != member:
        entry = data.index(b"PK\x01\x02", entry + 4)
    struct.pack_into("<II", data, entry + 16, zlib.crc32(kept), len(kept))  # CRC-32, compressed size
    return bytes(data)


def test_a_member_shorter_than_its_declared_size_is_refused_by_both_readers(tmp_path):
    """The npy header and the archive agree on 64 bytes of mask, but only 54 are stored (with their own CRC):
    validation reads the data and says so; the loader names numpy's own refusal."""
    path = tmp_path / "call0_rank0.npz"
    path.write_bytes(_short_member(_saved(tmp_path), b"mask.npy", 10))
    with pytest.raises(ValueError, match=r"call0_rank0.npz: member 'mask.npy' holds 182 bytes of data where the "
                                         r"archive declares 192 \(truncated or padded\)"):
        capture_io.validate_file(path)
    with pytest.raises(ValueError, match=r"call0_rank0.npz: a damaged array \(ValueError: EOF: reading array data, "
                                         r"expected 64 bytes got 54\); expected an npz archive"):
        capture_io.load_capture(path)


def test_validation_applies_the_shape_rules_to_a_file_s_headers(tmp_path):
    """A file of the right arrays and dtypes whose shapes break the format is refused before any check loads it."""
    q, k, v, mask = (t.numpy() for t in _tensors(heads=3, kv_heads=2))
    path = tmp_path / "call0_rank0.npz"
    np.savez(path, query=q, key=k, value=v, mask=mask)
    with pytest.raises(ValueError, match=rf"capture {re.escape(str(path))}: 3 query heads are not a multiple of 2 "
                                         "key/value heads"):
        capture_io.validate_file(path)


@pytest.mark.parametrize(("array", "value", "kind"), [("key", math.nan, "NaN"),
                                                      ("value", -math.inf, "an infinite value"),
                                                      ("query", math.inf, "an infinite value")])
def test_a_capture_holding_a_non_finite_value_is_refused_naming_the_array_and_its_first_position(
        tmp_path, array, value, kind):
    arrays = dict(zip(("query", "key", "value", "mask"), (t.numpy() for t in _tensors()), strict=True))
    arrays[array][0, 2, 1, 3] = value
    arrays[array][0, 4 if array != "query" else 2, 1, 3] = value
    path = tmp_path / "call0_rank0.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=rf"capture {re.escape(str(path))}: array '{array}' holds {kind} at "
                                         r"\(batch, seq, head, dim\) = \(0, 2, 1, 3\)"):
        capture_io.validate_file(path)


def test_a_query_row_whose_mask_admits_no_key_is_refused_naming_the_row(tmp_path):
    q, k, v, mask = (t.numpy() for t in _tensors(q_len=4))
    mask[0, 0, 2] = False
    path = tmp_path / "call0_rank0.npz"
    np.savez(path, query=q, key=k, value=v, mask=mask)
    with pytest.raises(ValueError, match=rf"capture {re.escape(str(path))}: mask row 2 of batch 0 admits no key "
                                         r"\(all False\); every query must see at least one key"):
        capture_io.validate_file(path)


def test_a_recorded_layout_naming_a_key_the_capture_lacks_is_refused_before_any_check_loads_it(tmp_path):
    """Positions past the file's keys parse as integers of the right shape: validation still refuses them."""
    q, k, v, mask = (t.numpy() for t in _tensors())
    path = tmp_path / "call0_rank0.npz"
    np.savez(path, query=q, key=k, value=v, mask=mask, positions=np.array([[3, 4, 5]]), spans=np.array([[[0, 2]]]))
    with pytest.raises(ValueError, match=r"positions\[0, 2\] = 5 is no key position of its 5 keys"):
        capture_io.validate_file(path)


def test_a_capture_path_that_is_a_directory_or_a_symlink_loop_says_so(tmp_path):
    (tmp_path / "call0_rank0.npz").mkdir()
    with pytest.raises(ValueError, match=r"call0_rank0.npz is a directory; expected an npz archive"):
        capture_io.validate_file(tmp_path / "call0_rank0.npz")
    loop = tmp_path / "call1_rank0.npz"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match=r"call1_rank0.npz is a symlink loop; expected an npz archive"):
        capture_io.validate_file(loop)
    dangling = tmp_path / "call2_rank0.npz"
    dangling.symlink_to(tmp_path / "gone.npz")
    with pytest.raises(ValueError, match=r"call2_rank0.npz is a symlink to .*gone.npz, which does not exist"):
        capture_io.validate_file(dangling)
    with pytest.raises(ValueError, match=r"capture directory .*call1_rank0.npz is a symlink loop; expected a "
                                         "directory of capture files"):
        capture_io.find_captures(loop)
    (tmp_path / "call3_rank0.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"capture directory .*call3_rank0.npz is a file; expected a directory of "
                                         "capture files"):
        capture_io.find_captures(tmp_path / "call3_rank0.npz")


def test_a_recorded_layout_needs_one_row_of_spans_per_query_row_and_each_span_inside_the_keys():
    """Spans are (B, N, 2): B the query's batch (not N), N >= 1; each span ``0 <= a < b <= KV``, an empty or
    reversed span refused wherever it lies."""
    capture_io.check_layout_shapes("ok", (2, 5, 4, 8), (2, 2, 9, 8), (2, 5), (2, 2, 2))
    capture_io.check_layout_shapes("one span a row", (2, 5, 4, 8), (2, 2, 9, 8), (2, 5), (2, 1, 2))
    with pytest.raises(ValueError, match=r"N >= 1"):
        capture_io.check_layout_shapes("no span", (2, 5, 4, 8), (2, 2, 9, 8), (2, 5), (2, 0, 2))
    with pytest.raises(ValueError, match=r"spans must be \(B, N, 2\) with B = 2"):
        capture_io.check_layout_shapes("rows", (2, 5, 4, 8), (2, 2, 9, 8), (2, 5), (3, 2, 2))  # N == B, B != 2
    positions = torch.tensor([[0, 1, 2]])
    capture_io.check_layout_values("ok", positions, torch.tensor([[[1, 3]]]), keys=4)
    capture_io.check_layout_values("every key", positions, torch.tensor([[[0, 4]]]), keys=4)  # 0 and KV included
    with pytest.raises(ValueError, match=r"spans\[0, 0\] = \[-1, 2\) is no span of its 4 keys"):
        capture_io.check_layout_values("before", positions, torch.tensor([[[-1, 2]]]), keys=4)
    for past in (3, 4):  # the last key is position 3: 4 is one past it
        with pytest.raises(ValueError, match=r"positions\[0, 2\] = \d is no key position of its 3 keys"):
            capture_io.check_layout_values("past", torch.tensor([[0, 1, past]]), torch.tensor([[[1, 3]]]), keys=3)
    for span in ([2, 2], [3, 1]):  # empty, reversed: both inside the keys
        with pytest.raises(ValueError, match=r"spans\[0, 0\] = \[\d, \d\) is no span of its 4 keys"):
            capture_io.check_layout_values("bad", positions, torch.tensor([[span]]), keys=4)
    with pytest.raises(ValueError, match=r"is no span of its 4 keys"):
        capture_io.check_layout_values("past", positions, torch.tensor([[[1, 5]]]), keys=4)


def test_a_capture_file_whose_recorded_spans_are_not_b_n_2_is_refused_from_its_headers(tmp_path):
    """Spans written as (B, N, 3) hold valid [a, b) pairs in their first two columns: only the shape is wrong."""
    q, k, v, mask = (t.numpy() for t in _tensors(q_len=3, kv_len=5))
    path = tmp_path / "call0_rank0.npz"
    np.savez(path, query=q, key=k, value=v, mask=mask, positions=np.array([[2, 3, 4]]),
             spans=np.array([[[0, 2, 0]]]))
    with pytest.raises(ValueError, match=r"spans must be \(B, N, 2\) with B = 1 .*got \(1, 1, 3\)"):
        capture_io.validate_file(path)


def test_a_file_without_a_four_dimensional_mask_is_no_capture_of_either_phase(tmp_path):
    """Each phase's files are read off their masks' shapes; a file holding no such mask belongs to neither (the
    directory's validation names it)."""
    q, k, v, mask = (t.numpy() for t in _tensors(q_len=5, kv_len=5))
    np.savez(tmp_path / "call0_rank0.npz", query=q, key=k, value=v, mask=mask)
    np.savez(tmp_path / "call1_rank0.npz", query=q, key=k, value=v)
    np.savez(tmp_path / "call2_rank0.npz", query=q, key=k, value=v, mask=mask[0])
    assert capture_io.phase_captures(tmp_path, "prefill") == [tmp_path / "call0_rank0.npz"]
    with pytest.raises(ValueError, match="holds no denoise capture"):
        capture_io.phase_captures(tmp_path, "denoise")
