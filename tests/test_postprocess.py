"""Post-hoc isotropy transforms: whitening(-k), all-but-the-top, standardization, NICE flow, pipelines."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hil.isotropy.linear_transforms import (
    MomentAccumulator,
    RemoveTopPCs,
    Standardize,
    Whitening,
)
from hil.isotropy.nice_flow import NICEFlow
from hil.isotropy.postprocess import (
    TransformPipeline,
    fit_transform_from_config,
    fit_whitening,
    load_transform,
    make_transform,
    parse_transform_spec,
    pool_for_fitting,
)


def correlated_gaussian(n: int = 20000, dim: int = 8, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """N(mu, A^T A) with a random dense mixing matrix A and a non-zero mean."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    mean = 3.0 * torch.randn(dim, generator=gen, dtype=torch.float64)
    return (torch.randn(n, dim, generator=gen, dtype=torch.float64) @ mixing + mean).to(dtype)


def numpy_whitening(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slow, obvious 000 Eqs. 7-10: loop sums for mu and Sigma, SVD, W = U diag(1/sqrt(s))."""
    n, dim = x.shape
    mu = np.zeros(dim)
    for row in x:
        mu += row
    mu /= n
    sigma = np.zeros((dim, dim))
    for row in x[:2000]:  # the loop is slow; finish with the same formula vectorised
        d = (row - mu)[None, :]
        sigma += d.T @ d
    rest = x[2000:] - mu
    sigma += rest.T @ rest
    sigma /= n - 1
    u, s, _ = np.linalg.svd(sigma)
    return mu, u / np.sqrt(s), s


def covariance(z: torch.Tensor) -> torch.Tensor:
    return torch.cov(z.T.to(torch.float64))


# ---------------------------------------------------------------------------------------------------- whitening

def test_whitening_gives_zero_mean_identity_covariance():
    x = correlated_gaussian()
    z = Whitening(renormalize=False).fit(x).transform(x)
    assert z.shape == (20000, 8)
    assert z.mean(dim=0).abs().max() < 1e-8
    assert (covariance(z) - torch.eye(8, dtype=torch.float64)).abs().max() < 0.05
    # and the input really was far from isotropic
    assert (covariance(x) - torch.eye(8, dtype=torch.float64)).abs().max() > 1.0


def test_whitening_matches_numpy_reference():
    x = correlated_gaussian(n=5000, seed=1)
    whitening = Whitening(renormalize=False, eps=0.0).fit(x)
    mu, w, s = numpy_whitening(x.numpy())
    np.testing.assert_allclose(whitening.mean.numpy(), mu, atol=1e-10)
    np.testing.assert_allclose(whitening.singular_values.numpy(), s, rtol=1e-8)
    # U is defined up to column signs: compare W W^T (= Sigma^{-1}) and |W|
    np.testing.assert_allclose((whitening.projection @ whitening.projection.T).numpy(), w @ w.T, rtol=1e-7,
                               atol=1e-9)
    np.testing.assert_allclose(whitening.projection.abs().numpy(), np.abs(w), rtol=1e-6, atol=1e-9)
    # the transform itself, row by row, against (x - mu) W up to the same column signs
    signs = torch.sign((whitening.projection * torch.from_numpy(w)).sum(dim=0))
    z = whitening.transform(x[:50])
    for i in range(50):
        expected = (x[i].numpy() - mu) @ w
        np.testing.assert_allclose((z[i] * signs).numpy(), expected, rtol=1e-7, atol=1e-9)


def test_whitening_k_keeps_top_k_directions_with_identity_covariance():
    x = correlated_gaussian()
    full = Whitening(renormalize=False).fit(x)
    reduced = Whitening(k=3, renormalize=False).fit(x)
    z = reduced.transform(x)
    assert z.shape == (20000, 3) and reduced.output_dim == 3 and reduced.input_dim == 8
    assert (covariance(z) - torch.eye(3, dtype=torch.float64)).abs().max() < 0.05
    # 002 Algorithm 1: the first k columns of the full W, i.e. the k largest-variance directions
    assert torch.allclose(reduced.projection, full.projection[:, :3])
    s = full.singular_values
    assert torch.all(s[:-1] >= s[1:])
    assert reduced.fit_info["explained_variance"] == pytest.approx(float(s[:3].sum() / s.sum()))


def test_whitening_renormalize_gives_unit_vectors_and_cosines_of_whitened_vectors():
    x = correlated_gaussian(n=2000)
    raw = Whitening(renormalize=False).fit(x).transform(x[:10])
    unit = Whitening().fit(x).transform(x[:10])
    assert torch.allclose(unit.norm(dim=-1), torch.ones(10, dtype=torch.float64))
    cos_raw = torch.nn.functional.cosine_similarity(raw[:, None], raw[None], dim=-1)
    assert torch.allclose(unit @ unit.T, cos_raw, atol=1e-12)


def test_whitening_rejects_bad_input():
    with pytest.raises(ValueError, match="k=9"):
        Whitening(k=9).fit(torch.randn(100, 8))
    with pytest.raises(ValueError, match="2-D"):
        Whitening().fit(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="at least 2"):
        Whitening().fit(torch.randn(1, 8))
    with pytest.raises(ValueError, match="NaN"):
        Whitening().fit(torch.full((4, 8), float("nan")))
    with pytest.raises(RuntimeError, match="not fitted"):
        Whitening().transform(torch.randn(3, 8))
    fitted = Whitening().fit(torch.randn(100, 8))
    with pytest.raises(ValueError, match="last dimension 8"):
        fitted.transform(torch.randn(3, 7))


def test_whitening_zero_variance_direction_stays_finite():
    x = torch.randn(500, 4, dtype=torch.float64)
    x[:, 3] = 2.0  # a constant dimension: singular value 0
    z = Whitening(renormalize=False).fit(x).transform(x)
    assert torch.isfinite(z).all()
    # eps = 1e-6 shifts the unit variances by ~eps / s: tiny next to the variances here
    assert (covariance(z[:, :3]) - torch.eye(3, dtype=torch.float64)).abs().max() < 1e-5


# ----------------------------------------------------------------------------------------- moments, pooling

@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 60), dim=st.integers(1, 6), chunk=st.integers(1, 70), offset=st.floats(-100, 100),
       seed=st.integers(0, 10_000))
def test_moment_accumulator_matches_numpy_cov(n, dim, chunk, offset, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)) * rng.uniform(0.1, 3, size=dim) + offset
    acc = MomentAccumulator()
    for start in range(0, n, chunk):
        acc.update(torch.from_numpy(x[start:start + chunk]))
    assert acc.count == n
    np.testing.assert_allclose(acc.mean.numpy(), x.mean(axis=0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(acc.covariance.numpy(), np.cov(x, rowvar=False).reshape(dim, dim), rtol=1e-7,
                               atol=1e-8)


def test_whitening_fit_moments_equals_fit():
    x = correlated_gaussian(n=3000)
    acc = MomentAccumulator()
    for chunk in x.split(700):
        acc.update(chunk.float())  # float32 chunks, float64 accumulation
    streamed = Whitening().fit_moments(acc.mean, acc.covariance, acc.count)
    direct = Whitening().fit(x.float())
    assert torch.allclose(streamed.projection, direct.projection, atol=1e-10)
    assert torch.allclose(streamed.mean, direct.mean, atol=1e-12)


@pytest.mark.parametrize("make", [lambda: RemoveTopPCs(n_components=2, renormalize=False),
                                  lambda: Standardize(renormalize=False)])
def test_every_linear_transform_fits_from_streamed_moments(make):
    # the moments of a corpus fed in chunks give the same transform as fitting on all vectors at once
    x = correlated_gaussian(n=3000, seed=8)
    acc = MomentAccumulator()
    for chunk in x.split(700):
        acc.update(chunk)
    streamed = make().fit_moments(acc.mean, acc.covariance, acc.count)
    direct = make().fit(x)
    assert streamed.fit_info == pytest.approx(direct.fit_info, rel=1e-12)
    for name, tensor in direct._state().items():
        assert torch.allclose(streamed._state()[name], tensor, atol=1e-10), name
    assert torch.allclose(streamed.transform(x[:50]), direct.transform(x[:50]), atol=1e-10)
    with pytest.raises(ValueError, match="fit_moments: expected mean"):
        make().fit_moments(acc.mean, acc.covariance[:3])


def test_pool_for_fitting_token_and_sequence_against_loops():
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(4, 5, 3, generator=gen, dtype=torch.float64)  # (B, L, D)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    tokens = pool_for_fitting(emb, mask, mode="token")
    expected_tokens = [emb[b, i] for b in range(4) for i in range(5) if mask[b, i]]
    assert torch.equal(tokens, torch.stack(expected_tokens))
    pooled = pool_for_fitting(emb, mask, mode="sequence")
    expected_pooled = []
    for b in range(4):
        rows = [emb[b, i] for i in range(5) if mask[b, i]]
        if rows:  # the empty sequence is dropped
            expected_pooled.append(sum(rows) / len(rows))
    assert torch.allclose(pooled, torch.stack(expected_pooled))
    assert pool_for_fitting(emb, mode="token").shape == (20, 3)
    with pytest.raises(ValueError, match="mask shape"):
        pool_for_fitting(emb, mask[:, :4])
    with pytest.raises(ValueError, match="mode"):
        pool_for_fitting(emb, mask, mode="document")


def test_fit_whitening_token_vs_sequence():
    gen = torch.Generator().manual_seed(4)
    emb = torch.randn(300, 6, 4, generator=gen, dtype=torch.float64) @ torch.randn(4, 4, generator=gen,
                                                                                  dtype=torch.float64)
    mask = torch.rand(300, 6, generator=gen) > 0.3
    token = fit_whitening(emb, mode="token", mask=mask, renormalize=False, eps=0.0)
    seq = fit_whitening(emb, mode="sequence", mask=mask, renormalize=False, eps=0.0)
    assert token.fit_info["mode"] == "token" and seq.fit_info["mode"] == "sequence"
    assert token.fit_info["n_vectors"] == int(mask.sum())
    z_tok = token.transform(emb[mask])
    assert (covariance(z_tok) - torch.eye(4, dtype=torch.float64)).abs().max() < 1e-8
    z_seq = seq.transform(pool_for_fitting(emb, mask, mode="sequence"))
    assert (covariance(z_seq) - torch.eye(4, dtype=torch.float64)).abs().max() < 1e-8
    # pooled vectors have smaller variance than tokens, so the two fits differ
    assert not torch.allclose(token.projection.abs(), seq.projection.abs(), rtol=0.1)


# ------------------------------------------------------------------------------ remove-pcs, standardize

def test_remove_top_pcs_orthogonal_to_removed_directions_and_matches_reference():
    x = correlated_gaussian(n=5000, seed=5)
    removed = RemoveTopPCs(n_components=2, renormalize=False).fit(x)
    z = removed.transform(x)
    assert z.shape == x.shape
    assert (z @ removed.components.T).abs().max() < 1e-9
    assert torch.allclose(removed.components @ removed.components.T, torch.eye(2, dtype=torch.float64))
    # slow reference (Mu et al. Algorithm 1): centre, top-2 eigenvectors of the covariance, subtract projections
    xn = x.numpy()
    centred = xn - xn.mean(axis=0)
    eigval, eigvec = np.linalg.eigh(np.cov(xn, rowvar=False))
    top = eigvec[:, np.argsort(eigval)[::-1][:2]]
    for i in range(20):
        expected = centred[i].copy()
        for j in range(2):
            expected -= (top[:, j] @ centred[i]) * top[:, j]
        np.testing.assert_allclose(z[i].numpy(), expected, atol=1e-9)
    # the remaining covariance has no variance along the removed directions and keeps the rest
    cov = covariance(z).numpy()
    np.testing.assert_allclose(top.T @ cov @ top, np.zeros((2, 2)), atol=1e-9)
    with pytest.raises(ValueError, match="n_components"):
        RemoveTopPCs(n_components=8).fit(x)


def test_standardize_matches_reference():
    x = correlated_gaussian(n=3000, seed=6)
    z = Standardize(renormalize=False).fit(x).transform(x)
    expected = (x - x.mean(dim=0)) / x.std(dim=0)
    assert torch.allclose(z, expected, atol=1e-10)
    assert torch.allclose(z.std(dim=0), torch.ones(8, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------- NICE

def randomize(flow: NICEFlow, seed: int = 0, scale: float = 0.1) -> NICEFlow:
    """Non-trivial parameters (the zero-initialized couplings would be the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in flow.parameters():
            param.copy_(scale * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        flow.center.copy_(torch.randn(flow.dim, generator=gen, dtype=flow.center.dtype))
        flow.initialized.fill_(True)
    return flow.eval()


def test_nice_is_invertible():
    flow = randomize(NICEFlow(7, n_couplings=4, hidden=32))  # odd D: unequal halves
    x = torch.randn(256, 7)
    with torch.no_grad():
        z, _ = flow(x)
        h = x - flow.center
        assert not torch.allclose(z, h * flow.log_scale.exp(), atol=0.1)  # the couplings do shift
        assert torch.allclose(flow.inverse(z), x, atol=1e-5)
        assert torch.allclose(flow(flow.inverse(x))[0], x, atol=1e-5)
        # larger shifts, float64: exact up to round-off
        flow64 = randomize(NICEFlow(7, n_couplings=4, hidden=32).double(), seed=2, scale=0.5)
        x64 = x.double()
        assert torch.allclose(flow64.inverse(flow64(x64)[0]), x64, atol=1e-10)


def test_nice_log_det_matches_numerical_jacobian():
    flow = randomize(NICEFlow(4, n_couplings=3, hidden=16).double(), seed=1)
    x = torch.randn(5, 4, dtype=torch.float64)
    _, log_det = flow(x)
    for i in range(5):
        jac = torch.zeros(4, 4, dtype=torch.float64)
        step = 1e-6
        for j in range(4):  # central differences, column by column
            e = torch.zeros(4, dtype=torch.float64)
            e[j] = step
            plus, _ = flow((x[i] + e)[None])
            minus, _ = flow((x[i] - e)[None])
            jac[:, j] = (plus - minus)[0] / (2 * step)
        assert float(log_det[i]) == pytest.approx(float(torch.linalg.slogdet(jac).logabsdet), abs=1e-6)
    # and log_prob is Eq. 5 with a standard Gaussian prior
    z, log_det = flow(x)
    manual = (-0.5 * z ** 2 - 0.5 * math.log(2 * math.pi)).sum(dim=1) + log_det
    assert torch.allclose(flow.log_prob(x), manual)


def test_nice_training_increases_held_out_likelihood(one_thread):
    gen = torch.Generator().manual_seed(7)
    # a curved, correlated, non-Gaussian cloud: the shift networks have something to learn beyond scaling
    base = torch.randn(4000, 6, generator=gen)
    base[:, 1] = base[:, 1] * 0.3 + base[:, 0] ** 2
    base[:, 3] = base[:, 3] * 0.3 + torch.sin(2 * base[:, 2])
    data = base @ torch.randn(6, 6, generator=gen) * 0.1 + 0.5
    train, held_out = data[:3000], data[3000:]
    flow = NICEFlow(6, n_couplings=4, hidden=32)
    flow._data_init(train)  # the starting point fit uses: per-dimension standardization
    with torch.no_grad():
        before = float(flow.log_prob(held_out).mean())
    flow.fit(train, epochs=20, batch_size=64, lr=5e-3, seed=0, max_steps=100)
    with torch.no_grad():
        after = float(flow.log_prob(held_out).mean())
    assert flow.fit_info["steps"] == 100
    assert after > before + 1.0, (before, after)
    assert flow.history[-1] < flow.history[0]
    z = flow.transform(held_out)
    assert torch.allclose(z.norm(dim=-1), torch.ones(len(held_out)), atol=1e-5)


def test_nice_fit_is_reproducible(one_thread):
    data = correlated_gaussian(n=600, dim=4, dtype=torch.float32)
    a = NICEFlow(4, hidden=16).fit(data, epochs=2, batch_size=64, seed=3)
    b = NICEFlow(4, hidden=16).fit(data, epochs=2, batch_size=64, seed=3)
    assert torch.equal(a.transform(data), b.transform(data))


# ------------------------------------------------------------------------------- shapes, masks, save/load

def fitted_examples() -> list:
    x = correlated_gaussian(n=1000, dtype=torch.float32)
    flow = NICEFlow(8, hidden=16).fit(x, epochs=1, batch_size=128)
    pipeline = fit_transform_from_config("standardize,whitening-k:k=5,nice:epochs=1:hidden=8", x)
    return [Whitening().fit(x), Whitening(k=4, renormalize=False).fit(x), RemoveTopPCs(2).fit(x),
            Standardize().fit(x), flow, pipeline, fit_transform_from_config("none", x)]


@pytest.fixture(scope="module")
def examples() -> list:
    return fitted_examples()


def test_transform_on_token_tensors_matches_rows(examples):
    tokens = correlated_gaussian(n=2 * 3 * 4, dtype=torch.float32, seed=9).reshape(2, 3, 4, 8)  # (..., L, D)
    mask = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(0)) > 0.4
    for transform in examples:
        out = transform.transform(tokens)
        assert out.shape == (2, 3, 4, transform.output_dim) and out.dtype == tokens.dtype
        rows = torch.stack([transform.transform(row[None])[0] for row in tokens.reshape(-1, 8)])
        assert torch.allclose(out.reshape(-1, transform.output_dim), rows, atol=1e-5), transform
        masked = transform.transform(tokens, mask=mask)
        assert torch.all(masked[~mask] == 0)
        assert torch.equal(masked[mask], out[mask])


def test_save_load_roundtrip_is_identical(examples, tmp_path: Path):
    x = correlated_gaussian(n=50, dtype=torch.float32, seed=11)
    for i, transform in enumerate(examples):
        path = transform.save(tmp_path / f"t{i}.pt")
        loaded = load_transform(path)
        assert type(loaded) is type(transform)
        assert loaded.settings() == transform.settings()
        assert torch.equal(loaded.transform(x), transform.transform(x)), transform
        again = type(transform).from_dict(transform.to_dict())
        assert torch.equal(again.transform(x), transform.transform(x))
        assert type(transform).load(path).settings() == transform.settings()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"t{i}.pt" for i in range(len(examples)))
    with pytest.raises(TypeError, match="not a Whitening"):
        Whitening.load(tmp_path / "t2.pt")
    with pytest.raises(FileNotFoundError):
        load_transform(tmp_path / "missing.pt")
    flow64 = NICEFlow(8, hidden=8).double().fit(x.double(), epochs=1, batch_size=16)
    loaded64 = load_transform(flow64.save(tmp_path / "flow64.pt"))
    assert loaded64.log_scale.dtype == torch.float64
    assert torch.equal(loaded64.transform(x.double()), flow64.transform(x.double()))
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="bad.pt"):
        load_transform(tmp_path / "bad.pt")


def test_save_is_atomic(tmp_path: Path, monkeypatch):
    path = Whitening().fit(correlated_gaussian(n=100)).save(tmp_path / "t.pt")
    before = path.read_bytes()

    def interrupted_save(payload, file):  # half a file written, then the disk fills up
        Path(file).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(OSError, match="disk full"):
        Standardize().fit(correlated_gaussian(n=100)).save(path)
    assert path.read_bytes() == before  # the old file is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["t.pt"]  # and no temporary is left behind


# ------------------------------------------------------------------------------------ registry, pipelines

def test_parse_transform_spec():
    assert parse_transform_spec("whitening:k=64") == [("whitening", {"k": 64})]
    assert parse_transform_spec("standardize, whitening") == [("standardize", {}), ("whitening", {})]
    assert parse_transform_spec("nice:epochs=5:lr=1e-3;renormalize=false") == [
        ("nice", {"epochs": 5, "lr": 1e-3, "renormalize": False})]
    assert parse_transform_spec("none") == [] and parse_transform_spec("") == []
    with pytest.raises(ValueError, match="key=value"):
        parse_transform_spec("whitening:64")


def test_make_transform_names_and_errors():
    assert isinstance(make_transform("whitening"), Whitening)
    assert make_transform("whitening-k", k=16).k == 16
    assert make_transform("whitening-256").k == 256
    assert make_transform("remove-pcs", n_components=3).n_components == 3
    assert isinstance(make_transform("standardize"), Standardize)
    assert make_transform("nice", dim=6).dim == 6
    with pytest.raises(ValueError, match="needs k"):
        make_transform("whitening-k")
    with pytest.raises(ValueError, match="needs dim"):
        make_transform("nice")
    with pytest.raises(ValueError, match="unknown transform"):
        make_transform("pca-whitening")
    with pytest.raises(ValueError, match="does not take"):
        make_transform("standardize", k=3)


def test_pipeline_equals_steps_applied_by_hand():
    x = correlated_gaussian(n=4000, seed=12)
    pipeline = fit_transform_from_config("standardize,whitening:k=6", x)
    assert isinstance(pipeline, TransformPipeline) and len(pipeline) == 2 and pipeline.output_dim == 6
    standardize, whitening = pipeline.steps
    assert not standardize.renormalize and whitening.renormalize  # only the last step renormalizes
    by_hand_std = Standardize(renormalize=False).fit(x)
    by_hand_white = Whitening(k=6).fit(by_hand_std.transform(x))
    assert torch.allclose(pipeline.transform(x[:100]), by_hand_white.transform(by_hand_std.transform(x[:100])))
    raw = fit_transform_from_config("standardize,whitening:k=6:eps=0", x, renormalize=False).transform(x)
    assert (covariance(raw) - torch.eye(6, dtype=torch.float64)).abs().max() < 1e-8
    # the spec records every setting and rebuilds the same pipeline
    assert parse_transform_spec(pipeline.spec) == [("standardize", {"eps": 1e-6, "renormalize": False}),
                                                   ("whitening", {"k": 6, "eps": 1e-6, "renormalize": True})]
    rebuilt = fit_transform_from_config(pipeline.spec, x)
    assert rebuilt.spec == pipeline.spec and torch.equal(rebuilt.transform(x[:20]), pipeline.transform(x[:20]))
    identity = fit_transform_from_config("none", x)
    assert torch.equal(identity.transform(x[:5]), x[:5])
    with pytest.raises(ValueError, match="step 2"):
        fit_transform_from_config("standardize,whitening:n_components=3", x)


def test_fit_transform_from_config_token_embeddings_with_mask():
    gen = torch.Generator().manual_seed(13)
    emb = torch.randn(50, 7, 4, generator=gen, dtype=torch.float64) @ torch.randn(4, 4, generator=gen,
                                                                                 dtype=torch.float64)
    mask = torch.rand(50, 7, generator=gen) > 0.2
    pipeline = fit_transform_from_config("whitening", emb, mask=mask, renormalize=False)
    direct = Whitening(renormalize=False).fit(emb[mask])
    assert torch.allclose(pipeline.steps[0].projection, direct.projection)
    nice = fit_transform_from_config("nice:epochs=1:batch_size=32:hidden=8", emb.float(), mask=mask)
    assert nice.steps[0].dim == 4 and nice.steps[0].fit_info["batch_size"] == 32
