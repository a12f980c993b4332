"""thd positions from ``cu_seqlens``: ``_cu_seqlens_search_kernel``, launched once per call by
``position_args``, against the plain-PyTorch spec ``mlarope.positions.token_positions``.

Runs on the ``device`` fixture: CPU tensors under Triton's interpreter in the CPU lane, CUDA in
the GPU lane. The kernel writes one int64 per token: its position, or PADDING_POSITION (the
int64 minimum; -1 in the hand-made cases below) for padding (tokens at
or past ``cu_seqlens[-1] // cp_size``).
"""

from __future__ import annotations

import pytest
import torch

from mlarope import _checks, reference
from mlarope.kernels.lookup import POS_SEARCHED, SEARCH_BLOCK, position_args, search_cu_seqlens
from mlarope.positions import PADDING_POSITION, Positions, search_steps, token_positions
from tests.errmodel import join_pairs, split_pairs

CP_RANKS = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
TABLE_ROWS = 1 << 20  # only bounds sequence lengths in the validity check


def cu_from_units(units: list[int], cp_size: int) -> list[int]:
    """Global ``cu_seqlens`` from lengths in units of ``2 * cp_size`` tokens (one token per
    local chunk; any length when ``cp_size == 1``), so every case is a valid call."""
    unit = 1 if cp_size == 1 else 2 * cp_size
    cu = [0]
    for n in units:
        cu.append(cu[-1] + n * unit)
    return cu


def lookup_case(name: str, cp_size: int) -> tuple[list[int], int]:
    """``(cu_seqlens, local token count)`` of a named case."""
    gen = torch.Generator().manual_seed(1234)
    if name == "edges":  # empty first, middle and next-to-last sequences; one-token chunks
        units = [0, 1, 0, 3, 1, 1, 0, 5]
        tail = 3
    elif name == "one-seq":
        units, tail = [6], 2
    elif name == "five-seqs":
        units, tail = [2, 0, 1, 4, 1], 1
    elif name == "300-seqs":  # 3 search steps, several search programs
        units = torch.randint(0, 4, (300,), generator=gen).tolist()
        tail = 5
    elif name == "300-seqs-no-tail":
        units = torch.randint(0, 4, (300,), generator=gen).tolist()
        tail = 0
    elif name == "all-empty":
        units, tail = [0, 0, 0], 4
    elif name == "no-seqs":  # cu_seqlens == [0]: every token is padding
        units, tail = [], 5
    else:
        raise ValueError(name)
    cu = cu_from_units(units, cp_size)
    return cu, cu[-1] // cp_size + tail


CASES = ["edges", "one-seq", "five-seqs", "300-seqs", "300-seqs-no-tail", "all-empty", "no-seqs"]


def kernel_positions(cu: torch.Tensor, n_tokens: int, cp_rank: int, cp_size: int, device):
    """``position_args`` on a thd batch of ``n_tokens`` -> the kernel's ``[T]`` positions."""
    x = torch.empty(n_tokens, 1, 1, device=device)  # stands in for q / kv: token count, device
    positions = _checks.check_positions(
        x, TABLE_ROWS, layout="thd", cu_seqlens=cu, position_ids=None, cp_rank=cp_rank,
        cp_size=cp_size,
    )  # fmt: skip
    _checks.check_positions_on_device(positions, n_tokens, TABLE_ROWS)  # a valid call
    pos_mode, (found, _, _, seq_len, _, _) = position_args(positions, x, (n_tokens, 1))
    assert pos_mode == POS_SEARCHED.value and seq_len == 0  # searched positions: no length
    assert found.dtype == torch.int64 and found.shape == (n_tokens,)
    assert found.device == x.device
    return positions, found


def spec_positions(positions, n_tokens: int, device) -> torch.Tensor:
    pos, is_padding = token_positions(positions, (n_tokens,), device)
    return torch.where(is_padding, PADDING_POSITION, pos)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cp", CP_RANKS, ids=lambda cp: f"cp{cp[0]}-rank{cp[1]}")
def test_cu_seqlens_positions_match_spec(cp, case, cu_dtype, device):
    """The position kernel gives ``token_positions``' positions, and the padding marker for
    exactly the padding tokens, for every rank of cp_size 1, 2 and 4, int32 and int64
    ``cu_seqlens``, empty and one-token-per-chunk sequences, padded tails, 1 to 300 sequences
    (0 to 3 search steps, several search programs) and ``cu_seqlens == [0]``."""
    cp_size, cp_rank = cp
    cu_list, n_tokens = lookup_case(case, cp_size)
    cu = torch.tensor(cu_list, dtype=cu_dtype, device=device)
    positions, got = kernel_positions(cu, n_tokens, cp_rank, cp_size, device)
    want = spec_positions(positions, n_tokens, device)
    assert int((want == PADDING_POSITION).sum()) == n_tokens - cu_list[-1] // cp_size
    bad = (got != want).nonzero().flatten().tolist()
    assert not bad, (
        f"{len(bad)} of {n_tokens} tokens differ, first {bad[:5]}: got "
        f"{got[bad[:5]].tolist()}, want {want[bad[:5]].tolist()}"
    )


def test_case_shapes_reach_the_search_limits():
    """The cases above reach what they claim: 300 sequences need 3 search steps (over 256 = 16**2
    sequences) and span more than one search program; 5 need one step, 1 and ``[0]`` none."""
    for cp_size in (1, 2, 4):
        cu, n_tokens = lookup_case("300-seqs", cp_size)
        assert len(cu) - 1 == 300 and search_steps(300) == 3 and search_steps(256) == 2
        assert n_tokens > SEARCH_BLOCK
        assert lookup_case("no-seqs", cp_size)[0] == [0] and search_steps(0) == 0
        assert search_steps(5) == 1 and search_steps(1) == 0


@pytest.mark.parametrize(
    ("cu_list", "n_tokens", "cp_rank", "cp_size", "expected"),
    [
        # sequences of 3, 0, 1 and 2 tokens, then 2 padding tokens
        ([0, 3, 3, 4, 6], 8, 0, 1, [0, 1, 2, 0, 0, 1, -1, -1]),
        # global lengths 4, 0, 8 over 2 ranks (chunks of 1, 1 and 2 tokens), 1 padding token:
        # rank 0 holds global chunks 0 and 3, rank 1 chunks 1 and 2
        ([0, 4, 4, 12], 7, 0, 2, [0, 3, 0, 1, 6, 7, -1]),
        ([0, 4, 4, 12], 7, 1, 2, [1, 2, 2, 3, 4, 5, -1]),
        ([0], 3, 0, 1, [-1, -1, -1]),
    ],
    ids=["cp1", "cp2-rank0", "cp2-rank1", "no-seqs"],
)
def test_cu_seqlens_positions_by_hand(cu_list, n_tokens, cp_rank, cp_size, expected, device):
    """Worked examples, so the kernel and the spec are not only checked against each other."""
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    positions, got = kernel_positions(cu, n_tokens, cp_rank, cp_size, device)
    expected = [PADDING_POSITION if p == -1 else p for p in expected]
    assert got.tolist() == expected
    assert spec_positions(positions, n_tokens, device).tolist() == expected


@pytest.mark.parametrize("cu_list", [[2, 5, 8], [3, 5, 8]], ids=["starts-at-2", "starts-at-3"])
def test_malformed_cu_seqlens_give_nan_not_silence(cu_list, device):
    """Without validation, ``cu_seqlens[0] != 0`` gives the first tokens negative positions;
    those rows must come out NaN (out of range), as in the reference, never pass through
    unrotated as if they were padding: only the kernel's padding marker means padding. (Other
    malformed ``cu_seqlens``, e.g. decreasing ones, are undefined in the spec too;
    ``validate=True`` rejects them all.)"""
    import mlarope

    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(64, device=device)
    q = torch.randn(8, 2, 16 + 64, device=device)
    got = mlarope.apply_rope_q(q, cos, sin, layout="thd", cu_seqlens=cu)
    want = reference.apply_rope_q(
        q.double().cpu(), cos.double().cpu(), sin.double().cpu(), layout="thd",
        cu_seqlens=cu.cpu(),
    )  # fmt: skip
    nan_rows = want[..., 16:].isnan().all(-1).all(-1)
    assert bool(nan_rows.any()), "the case should have out-of-range rows"
    assert torch.equal(got[..., 16:].isnan().all(-1).all(-1).cpu(), nan_rows)


def random_malformed_cu_seqlens(gen: torch.Generator) -> tuple[list[int], torch.dtype]:
    """Any int values: shuffled or out-of-order entries, not starting at 0, negative, a single
    entry, totals beyond the tokens, and the extremes of int32 and int64."""
    n = int(torch.randint(1, 40, (1,), generator=gen))
    kind = int(torch.randint(0, 5, (1,), generator=gen))
    if kind == 0:  # anything in a small range
        values = torch.randint(-20, 60, (n,), generator=gen)
    elif kind == 1:  # sorted, then one entry moved
        values = torch.randint(-10, 60, (n,), generator=gen).sort().values
        values[int(torch.randint(0, n, (1,), generator=gen))] = int(
            torch.randint(-30, 80, (1,), generator=gen)
        )
    elif kind == 2:  # well formed but for the start
        values = torch.randint(0, 9, (n,), generator=gen).cumsum(0) + int(
            torch.randint(-12, 12, (1,), generator=gen)
        )
    elif kind == 3:  # int32 extremes among small values
        pool = torch.tensor([-(2**31), 2**31 - 1, 0, 5, -5, 2**30, 17])
        values = pool[torch.randint(0, len(pool), (n,), generator=gen)]
    else:  # int64 extremes (positions wrap around in 64 bits, on every backend alike)
        pool = torch.tensor([-(2**63), 2**63 - 1, 0, 7, -(2**62), 2**62, 2**53, -3])
        values = pool[torch.randint(0, len(pool), (n,), generator=gen)]
        return values.tolist(), torch.int64
    dtype = torch.int32 if int(torch.randint(0, 2, (1,), generator=gen)) else torch.int64
    return values.tolist(), dtype


def test_malformed_cu_seqlens_positions_match_the_spec(device):
    """For ANY int ``cu_seqlens`` (the ones ``validate=True`` rejects), the reference's positions
    and padding (``positions.token_positions``) are the kernel's, token for token, for
    ``cp_size`` 1 to 4 and every rank: the CPU and GPU backends write the same rows. (Before,
    the reference took its own path through malformed ``cu_seqlens``: ``[5]`` made every token
    padding there and NaN rows 0-4 in the kernels.)"""
    gen = torch.Generator().manual_seed(2024)
    for trial in range(120):
        cu_list, dtype = random_malformed_cu_seqlens(gen)
        cp_size = int(torch.randint(1, 5, (1,), generator=gen))
        cp_rank = int(torch.randint(0, cp_size, (1,), generator=gen))
        n_tokens = int(torch.randint(1, 70, (1,), generator=gen))
        cu = torch.tensor(cu_list, dtype=dtype, device=device)
        positions = Positions("thd", cu, None, cp_rank, cp_size)
        got = search_cu_seqlens(cu, n_tokens, cp_rank, cp_size)
        want = spec_positions(positions, n_tokens, device)
        assert torch.equal(got, want), (
            f"trial {trial}: cu_seqlens={cu_list} ({dtype}), cp {cp_rank}/{cp_size}, "
            f"{n_tokens} tokens: kernel {got.tolist()}, spec {want.tolist()}"
        )


@pytest.mark.parametrize("cu_list", [[5], [0, 6, 3, 10], [4, 2, 9], [-3, 4, 8], [0, 12]], ids=str)
@pytest.mark.parametrize("op", ["q", "kv"])
def test_malformed_cu_seqlens_same_rows_on_every_backend(cu_list, op, device):
    """The issue's cases on T = 10 (``[5]``: NaN rows 0-4, padding after; ``[0, 6, 3, 10]``: NaN
    rows 3-5) and others: the kernels and the reference backend write the same rows, rotated
    with the same positions, NaN in the same rows, passed through in the same rows."""
    import mlarope

    cu = torch.tensor(cu_list, dtype=torch.int32)
    cos, sin = mlarope.YarnConfig(dim=32).cos_sin(12)
    x = torch.randn(10, 2, 16 + (32 if op == "q" else 8))
    k_pe = torch.randn(10, 32)

    def run(dev, dtype):
        args = dict(layout="thd", cu_seqlens=cu.to(dev))
        t = lambda a: a.to(dev, dtype)
        if op == "q":
            return mlarope.apply_rope_q(t(x), t(cos), t(sin), **args)
        k, v = mlarope.apply_rope_kv(t(x), t(k_pe), t(cos), t(sin), k_dim=16, **args)
        return torch.cat((k, v), dim=-1)

    got = run(device, torch.float32).double().cpu()
    want = run("cpu", torch.float64)  # float64: the reference backend
    assert torch.equal(got.isnan(), want.isnan()), "NaN in other rows"
    torch.testing.assert_close(got.nan_to_num(0), want.nan_to_num(0), rtol=1e-6, atol=1e-6)
    if cu_list == [5]:
        rows_nan = want[..., 16:48].isnan().all(-1).all(-1)  # the rope channels
        assert rows_nan.tolist() == [True] * 5 + [False] * 5
        if op == "q":  # padding: the input's pairs, re-laid out (interleaved -> halves)
            a, b = split_pairs(x[5:, :, 16:].double(), True)
            assert torch.equal(want[5:, :, 16:], join_pairs(a, b, False))


@pytest.mark.parametrize("op", ["q", "q_inplace", "q_inplace_backward", "kv", "kv_no_copy_v"])
@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 1)])
def test_autograd_searches_once_for_forward_and_backward(op, cp_size, cp_rank, device, monkeypatch):
    """An eager forward with ``cu_seqlens`` and autograd searches once; its backward reads the
    forward's positions (``ops.search_for_backward``) instead of searching again, with the
    same bits as a backward that searches again. (Searches are counted by wrapping the search
    launch: autograd runs a CUDA backward on its own thread.)"""
    import mlarope
    from mlarope import autograd
    from mlarope._launch_cache import clear_launch_cache
    from mlarope.kernels import lookup
    from mlarope.kernels._launch import recording

    searches: list[str] = []
    backward_launches: list[int] = []
    search = lookup.launch_cu_seqlens_search

    def counted(*args, **kwargs):
        searches.append(phase)
        return search(*args, **kwargs)

    monkeypatch.setattr(lookup, "launch_cu_seqlens_search", counted)
    cu = torch.tensor(cu_from_units([2, 0, 3, 1], cp_size), dtype=torch.int32, device=device)
    n_tokens = int(cu[-1]) // cp_size + 2  # a padded tail
    cos = torch.randn(64, 32, device=device)
    sin = torch.randn(64, 32, device=device)
    where = dict(layout="thd", cu_seqlens=cu, cp_rank=cp_rank, cp_size=cp_size)
    x0 = torch.randn(n_tokens, 3, 16 + 32, device=device)
    k_pe0 = torch.randn(n_tokens, 32, device=device)

    def run() -> list:
        nonlocal phase
        x = x0.clone().requires_grad_(True)
        k_pe = k_pe0.clone().requires_grad_(True)
        phase = "forward"
        if op.startswith("q"):
            inplace = op != "q"
            outs = (
                mlarope.apply_rope_q(
                    x * 1 if inplace else x, cos, sin, inplace=inplace,
                    inplace_backward=op == "q_inplace_backward", **where,
                ),
            )  # fmt: skip
        else:
            outs = mlarope.apply_rope_kv(x, k_pe, cos, sin, k_dim=16, copy_v=op == "kv", **where)
        grads = [torch.randn_like(o) for o in outs]
        phase = "backward"
        with recording() as launches:
            got = torch.autograd.grad(outs, (x,) if op.startswith("q") else (x, k_pe), grads)
        if device.type == "cpu":  # the engine's own thread for CUDA, where this records nothing
            backward_launches.append(len(launches))
        return [g.nan_to_num(7) for g in got]

    phase = ""
    torch.manual_seed(1)
    grads = run()
    assert searches == ["forward"], "the backward reads the forward's positions"
    searches.clear()
    monkeypatch.setattr(autograd, "search_for_backward", lambda x, call: call)
    clear_launch_cache()  # the pipeline again, not the first call's plan (test_thd_plans.py)
    torch.manual_seed(1)
    again = run()
    assert searches == ["forward", "backward"], "without them each direction searches"
    expected = [1, 2] if device.type == "cpu" else []
    assert backward_launches == expected, "the backward's kernel alone, then search + kernel"
    for a, b in zip(grads, again, strict=True):
        assert torch.equal(a, b)


def test_search_for_backward_only_where_the_kernels_search(device):
    """No saved positions without ``cu_seqlens``, without tokens, on the reference backend."""
    from mlarope import ops

    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    x = torch.randn(6, 2, 48, device=device)
    cos = torch.randn(8, 32, device=device)

    def call(cu_seqlens):
        return ops.QueryCall(cos, cos, cu_seqlens, None, None, "thd", 0, 1, True, False, False,
                             False)  # fmt: skip

    assert ops.search_for_backward(x, call(None)).searched is None
    assert ops.search_for_backward(x[:0], call(cu)).searched is None
    assert ops.search_for_backward(x.double(), call(cu)).searched is None
    found = ops.search_for_backward(x, call(cu)).searched
    if not ops.use_triton(x):  # a CPU lane without the interpreter: the reference searches
        assert found is None
        return
    expected = position_args(Positions("thd", cu, None, 0, 1), x, (6, 1))[1][0]
    assert found.dtype == torch.int64 and torch.equal(found, expected)
