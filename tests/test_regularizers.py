"""Isotropy regularizers: values against slow references, lambda handling, I-STAR buffers, and training direction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.isotropy.metrics import avg_cos, inter_iso, isoscore, isoscore_star, masked_tokens
from hil.isotropy.regularizers import (
    CosRegRegularizer,
    InterIsoRegularizer,
    IStarRegularizer,
    Regularizer,
    cosreg,
    interiso_reg,
    istar_reg,
)

torch.set_num_threads(1)


def cosreg_loop(x: torch.Tensor) -> float:
    """1 / M^2 * sum_{i != j} cos(x_i, x_j), written the obvious way."""
    m = len(x)
    unit = [x[i] / x[i].norm() for i in range(m)]
    return sum(float(unit[i] @ unit[j]) for i in range(m) for j in range(m) if i != j) / m ** 2


def batch(seed: int = 0, bq: int = 3, lq: int = 4, ld: int = 5, d: int = 6):
    """Queries once, docs = [positives; negatives], with padding filled by garbage values."""
    g = torch.Generator().manual_seed(seed)
    queries = F.normalize(torch.randn(bq, lq, d, generator=g, dtype=torch.float64), dim=-1)
    docs = F.normalize(torch.randn(2 * bq, ld, d, generator=g, dtype=torch.float64), dim=-1)
    query_mask = torch.rand(bq, lq, generator=g) > 0.3
    doc_mask = torch.rand(2 * bq, ld, generator=g) > 0.3
    query_mask[:, :2] = True
    doc_mask[:, :2] = True
    queries[~query_mask] = 9.0
    docs[~doc_mask] = -9.0
    return queries, docs, query_mask, doc_mask


# ---------------------------------------------------------------------------------------------------------------
# The terms
# ---------------------------------------------------------------------------------------------------------------

def test_interiso_reg_raw_or_absolute_value_per_pair():
    values = torch.tensor([0.5, -0.3, 0.1])
    assert interiso_reg(values, absolute=False).item() == pytest.approx(0.1, abs=1e-7)     # mean InterIso
    assert interiso_reg(values, absolute=True).item() == pytest.approx(0.9 / 3, abs=1e-7)  # mean |InterIso| per pair
    with pytest.raises(ValueError, match=r"\(B,\)"):
        interiso_reg(values[None], absolute=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.integers(1, 5), st.integers(0, 2 ** 16))
def test_cosreg_equals_pair_loop(m, d, seed):
    x = torch.randn(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    expected = cosreg_loop(x) if m >= 2 else 0.0
    assert cosreg(x).item() == pytest.approx(expected, abs=1e-10)


def test_istar_reg_is_one_minus_isoscore_star():
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    c = torch.eye(4, dtype=torch.float64)
    assert istar_reg(x, c, 0.2).item() == pytest.approx(1 - isoscore_star(x, c, 0.2).item(), abs=1e-12)
    assert istar_reg(x[:1], c).item() == 0.0


# ---------------------------------------------------------------------------------------------------------------
# The regularizer objects: lambda, pairing, queries and documents apart, padding excluded
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lam", [0.4, -0.1])
def test_interiso_loss_over_query_doc_pairs(lam):
    queries, docs, query_mask, doc_mask = batch()
    pair_index = torch.arange(3).repeat(2)
    loss, logs = InterIsoRegularizer(lam)(queries, docs, query_mask, doc_mask, pair_index)
    per_pair = []
    for k in range(6):
        q = queries[pair_index[k]][query_mask[pair_index[k]]]
        d = docs[k][doc_mask[k]]
        per_pair.append(float((q @ d.T).mean()))
    expected_reg = sum(per_pair) / 6 if lam < 0 else sum(abs(v) for v in per_pair) / 6
    assert loss.item() == pytest.approx(lam * expected_reg, abs=1e-10)
    assert logs["reg"].item() == pytest.approx(expected_reg, abs=1e-10)
    assert logs["inter_iso"].item() == pytest.approx(sum(per_pair) / 6, abs=1e-10)
    # The same as passing the queries repeated row by row, or InterIso values computed elsewhere.
    repeated, _ = InterIsoRegularizer(lam)(queries[pair_index], docs, query_mask[pair_index], doc_mask)
    assert repeated.item() == pytest.approx(loss.item(), abs=1e-12)
    given, _ = InterIsoRegularizer(lam)(queries, docs, query_mask, doc_mask, pair_index,
                                        inter_iso_values=torch.tensor(per_pair, dtype=torch.float64))
    assert given.item() == pytest.approx(loss.item(), abs=1e-10)


@pytest.mark.parametrize("kind", ["cosreg", "istar"])
def test_cosreg_and_istar_are_half_lambda_times_query_plus_doc_terms(kind):
    queries, docs, query_mask, doc_mask = batch(seed=3)
    query_points = torch.cat([queries[b][query_mask[b]] for b in range(3)])   # valid tokens only
    doc_points = torch.cat([docs[b][doc_mask[b]] for b in range(6)])
    if kind == "cosreg":
        reg_q, reg_d = cosreg_loop(query_points), cosreg_loop(doc_points)
    else:
        eye = torch.eye(query_points.shape[1], dtype=torch.float64)
        reg_q = 1 - isoscore_star(query_points, eye).item()
        reg_d = 1 - isoscore_star(doc_points, eye).item()
    lam = -0.6
    regularizer = CosRegRegularizer(lam) if kind == "cosreg" else IStarRegularizer(lam, shrinkage_target="identity")
    loss, logs = regularizer(queries, docs, query_mask, doc_mask, torch.arange(3).repeat(2))
    assert loss.item() == pytest.approx(lam / 2 * (reg_q + reg_d), abs=1e-9)
    assert logs["reg_query"].item() == pytest.approx(reg_q, abs=1e-9)
    assert logs["reg_doc"].item() == pytest.approx(reg_d, abs=1e-9)
    assert logs["reg"].item() == pytest.approx((reg_q + reg_d) / 2, abs=1e-9)


def test_bad_arguments_are_named():
    queries, docs, query_mask, doc_mask = batch()
    with pytest.raises(ValueError, match="pair_index"):
        InterIsoRegularizer(0.1)(queries, docs, query_mask, doc_mask)
    with pytest.raises(ValueError, match="shrinkage_target"):
        IStarRegularizer(0.2, shrinkage_target="rolling")
    with pytest.raises(ValueError, match="needs dim"):  # running shrinkage without a D, never bound to an encoder
        IStarRegularizer(0.2, shrinkage_target="running")(queries, docs, query_mask, doc_mask,
                                                          torch.arange(3).repeat(2))
    bound = IStarRegularizer(0.2, shrinkage_target="running")
    bound.bind(6)
    assert bound.doc_shrinkage_cov.shape == (6, 6)
    with pytest.raises(ValueError, match="dim=6"):
        bound.bind(8)


# ---------------------------------------------------------------------------------------------------------------
# I-STAR shrinkage covariance
# ---------------------------------------------------------------------------------------------------------------

def test_istar_identity_target_shrinks_toward_identity():
    queries, docs, query_mask, doc_mask = batch(seed=4)
    module = IStarRegularizer(0.2, zeta=0.3)
    loss, logs = module(queries, docs, query_mask, doc_mask, torch.arange(3).repeat(2))
    eye = torch.eye(6, dtype=torch.float64)
    reg_q = istar_reg(masked_tokens(queries, query_mask), eye, 0.3).item()
    assert logs["reg_query"].item() == pytest.approx(reg_q, abs=1e-6)
    assert len(list(module.buffers())) == 0


def test_istar_running_covariance_is_an_ema_of_batch_covariances_and_is_checkpointed():
    momentum, zeta = 0.25, 0.2
    module = IStarRegularizer(0.2, zeta=zeta, shrinkage_target="running", momentum=momentum, dim=6)
    first, second = batch(seed=5), batch(seed=6)
    pairs = torch.arange(3).repeat(2)

    def doc_cov(b):
        return torch.cov(masked_tokens(b[1], b[3]).T).float()

    # Step 1: no history yet -> batch covariance alone; the buffer becomes that covariance.
    _, logs1 = module(*first, pairs)
    assert logs1["reg_doc"].item() == pytest.approx(istar_reg(masked_tokens(first[1], first[3]), None).item(),
                                                    abs=1e-5)
    assert torch.allclose(module.doc_shrinkage_cov, doc_cov(first), atol=1e-6)
    # Step 2: shrinks toward step 1's covariance, then averages.
    _, logs2 = module(*second, pairs)
    expected = istar_reg(masked_tokens(second[1], second[3]), doc_cov(first).double(), zeta).item()
    assert logs2["reg_doc"].item() == pytest.approx(expected, abs=1e-5)
    ema = (1 - momentum) * doc_cov(first) + momentum * doc_cov(second)
    assert torch.allclose(module.doc_shrinkage_cov, ema, atol=1e-6)
    assert int(module.query_shrinkage_updates) == 2
    # Evaluation does not move the average.
    module.eval()
    module(*first, pairs)
    assert torch.allclose(module.doc_shrinkage_cov, ema, atol=1e-6)
    # The average travels in the state dict.
    restored = IStarRegularizer(0.2, zeta=zeta, shrinkage_target="running", momentum=momentum, dim=6)
    restored.load_state_dict(module.state_dict())
    assert torch.equal(restored.doc_shrinkage_cov, module.doc_shrinkage_cov)
    assert torch.equal(restored.query_shrinkage_cov, module.query_shrinkage_cov)
    assert int(restored.doc_shrinkage_updates) == 2


# ---------------------------------------------------------------------------------------------------------------
# A few optimizer steps with the sign of lambda move the measured isotropy the intended way
# ---------------------------------------------------------------------------------------------------------------

def _train_only_regularizer(regularizer: Regularizer, steps: int = 30):
    """A learnable linear map 16 -> 8 plus L2 normalization on fixed inputs, trained on the regularizer alone.

    Returns the measured (|InterIso|, Avg-Cos, IsoScore) before and after, each over the valid tokens.
    """
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(16, generator=g)  # a common component so that the start is neither isotropic nor collapsed
    queries_in = torch.randn(8, 5, 16, generator=g) + shared
    docs_in = torch.randn(16, 9, 16, generator=g) + shared
    query_mask = torch.rand(8, 5, generator=g) > 0.2
    doc_mask = torch.rand(16, 9, generator=g) > 0.3
    query_mask[:, 0] = True
    doc_mask[:, 0] = True
    pair_index = torch.arange(8).repeat(2)
    projection = torch.nn.Linear(16, 8, bias=False)
    optimizer = torch.optim.Adam(projection.parameters(), lr=0.05)

    def encode():
        return F.normalize(projection(queries_in), dim=-1), F.normalize(projection(docs_in), dim=-1)

    def measure():
        with torch.no_grad():
            q, d = encode()
            q_points, d_points = masked_tokens(q, query_mask), masked_tokens(d, doc_mask)
            return {
                "inter_iso": inter_iso(q[pair_index], d, query_mask[pair_index], doc_mask).abs().mean().item(),
                "avg_cos": avg_cos(torch.cat([q_points, d_points])).item(),
                "isoscore": (isoscore(q_points).item() + isoscore(d_points).item()) / 2,
            }

    before = measure()
    for _ in range(steps):
        q, d = encode()
        loss, _ = regularizer(q, d, query_mask, doc_mask, pair_index)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return before, measure()


@pytest.mark.parametrize("kind,metric,isotropic_is_lower", [
    (InterIsoRegularizer, "inter_iso", True),   # InterIso -> 0 isotropic, -> 1 anisotropic
    (CosRegRegularizer, "avg_cos", True),
    (IStarRegularizer, "isoscore", False),      # IsoScore -> 1 isotropic, -> 0 anisotropic
])
@pytest.mark.parametrize("lam", [0.5, -0.5])
def test_sign_of_lambda_moves_isotropy_the_intended_way(kind, metric, isotropic_is_lower, lam):
    before, after = _train_only_regularizer(kind(lam))
    change = after[metric] - before[metric]
    towards_isotropy = -change if isotropic_is_lower else change
    if lam > 0:
        assert towards_isotropy > 0.1, (before, after)
    else:
        assert towards_isotropy < -0.1, (before, after)


@pytest.mark.parametrize("lam", [0.5, -0.5])
def test_istar_with_running_shrinkage_moves_isoscore_the_intended_way(lam):
    before, after = _train_only_regularizer(IStarRegularizer(lam, shrinkage_target="running", dim=8))
    change = after["isoscore"] - before["isoscore"]
    assert (change > 0.1) if lam > 0 else (change < -0.1), (before, after)


# -- the valid tokens weighted instead of selected (no host sync on an accelerator) ---------------------------------

def weighted_and_selected(seed: int, valid: int | None = None):
    """A padded (B, L, D) token batch and its mask; ``valid`` keeps only that many valid tokens (0 or 1: no pair)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    if valid is not None:
        mask[:] = False
        mask.view(-1)[:valid] = True
    return x, mask


@pytest.mark.parametrize("seed", range(4))
def test_weighted_token_clouds_equal_the_selected_ones(seed):
    """CosReg, I-STAR (identity and no shrinkage) and the covariance on (points, weights) against the same
    functions on the selected valid tokens (and the covariance against torch.cov), values and gradients."""
    from hil.isotropy.metrics import covariance, token_cloud

    x, mask = weighted_and_selected(seed)
    selected = masked_tokens(x, mask)
    points, weights = token_cloud(x, mask)
    assert weights.dtype == x.dtype and weights.tolist() == mask.reshape(-1).double().tolist()
    torch.testing.assert_close(covariance(points, weights), torch.cov(selected.T), rtol=1e-12, atol=1e-12)
    for name, weighted, plain in [
            ("cosreg", lambda p, w: cosreg(p, w), lambda p: cosreg(p)),
            ("istar identity", lambda p, w: istar_reg(p, torch.eye(6), 0.2, w), lambda p: istar_reg(p, torch.eye(6))),
            ("istar batch", lambda p, w: istar_reg(p, None, 0.2, w), lambda p: istar_reg(p, None))]:
        leaf_a, leaf_b = x.clone().requires_grad_(), x.clone().requires_grad_()
        value_a = weighted(*token_cloud(leaf_a, mask))
        value_b = plain(masked_tokens(leaf_b, mask))
        torch.testing.assert_close(value_a, value_b, rtol=1e-10, atol=1e-12, msg=name)
        value_a.backward()
        value_b.backward()
        torch.testing.assert_close(leaf_a.grad, leaf_b.grad, rtol=1e-8, atol=1e-12, msg=name)


@pytest.mark.parametrize("valid", [0, 1])
def test_a_weighted_cloud_without_a_pair_gives_0_and_finite_gradients(valid):
    from hil.isotropy.metrics import token_cloud

    x, mask = weighted_and_selected(0, valid)
    for term in (lambda p, w: cosreg(p, w), lambda p, w: istar_reg(p, torch.eye(6), 0.2, w),
                 lambda p, w: istar_reg(p, None, 0.2, w)):
        leaf = x.clone().requires_grad_()
        value = term(*token_cloud(leaf, mask))
        assert value.item() == 0.0
        value.backward()
        assert torch.isfinite(leaf.grad).all() and not leaf.grad.any()


@pytest.mark.parametrize("regularizer", [lambda: CosRegRegularizer(0.2), lambda: IStarRegularizer(-0.6),
                                         lambda: IStarRegularizer(0.2, shrinkage_target="running", dim=6)])
def test_on_an_accelerator_the_token_cloud_terms_read_nothing_back(regularizer, monkeypatch):
    """The path taken off the CPU (forced here): no boolean selection, no scalar read (what waits for a GPU), and
    the same values to rounding as the CPU's selection; I-STAR's running average too (its update count, read once
    a step, is the one read left: running shrinkage only)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hil.isotropy import regularizers
    from hil.isotropy.metrics import token_cloud

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
                        torch.ops.aten.masked_select.default):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    queries, query_mask = weighted_and_selected(1)
    docs, doc_mask = weighted_and_selected(2)
    on_cpu, off_cpu = regularizer(), regularizer()
    expected = [on_cpu.term(queries, docs, query_mask, doc_mask)[0] for _ in range(2)]
    monkeypatch.setattr(regularizers, "_valid_tokens", lambda device: token_cloud)
    reads = Reads()
    got = []
    for _ in range(2):
        with reads:
            got.append(off_cpu.term(queries, docs, query_mask, doc_mask)[0])
    running = getattr(on_cpu, "shrinkage_target", None) == "running"
    assert reads.ops == (["aten._local_scalar_dense.default"] * 4 if running else [])
    # fp64 points; the running average is a float32 buffer, whose rounding the two paths reach differently
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-6 if running else 1e-10, atol=1e-12)
    if running:
        for side in ("query", "doc"):
            torch.testing.assert_close(getattr(off_cpu, f"{side}_shrinkage_cov"),
                                       getattr(on_cpu, f"{side}_shrinkage_cov"), rtol=1e-6, atol=1e-7)
            assert int(getattr(off_cpu, f"{side}_shrinkage_updates")) == 2


def test_the_token_cloud_is_selected_on_a_cpu_and_weighted_elsewhere():
    from hil.isotropy.metrics import token_cloud
    from hil.isotropy.regularizers import _selected_tokens, _valid_tokens

    assert _valid_tokens(torch.device("cpu")) is _selected_tokens
    assert _valid_tokens(torch.device("cuda", 0)) is token_cloud and _valid_tokens(torch.device("meta")) is token_cloud


@pytest.mark.parametrize("valid", [0, 1])
def test_the_running_average_skips_a_weighted_cloud_without_a_pair(valid, monkeypatch):
    from hil.isotropy import regularizers
    from hil.isotropy.metrics import token_cloud

    monkeypatch.setattr(regularizers, "_valid_tokens", lambda device: token_cloud)
    istar = IStarRegularizer(0.2, shrinkage_target="running", dim=6)
    full, full_mask = weighted_and_selected(3)
    istar.term(full, full, full_mask, full_mask)  # one real update
    before = istar.query_shrinkage_cov.clone()
    sparse, sparse_mask = weighted_and_selected(4, valid)
    istar.term(sparse, full, sparse_mask, full_mask)
    assert torch.equal(istar.query_shrinkage_cov, before) and int(istar.query_shrinkage_updates) == 1
    assert int(istar.doc_shrinkage_updates) == 2
