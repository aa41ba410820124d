"""Sharing: the model card written from an export and its metrics.json files, and the push (to a stand-in hub)."""

from __future__ import annotations

import json

import pytest
import torch

from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.export import export_model
from hil.modeling.hub import HubError, local_model_dir, model_card, push_to_hub

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def export(shared_dir, tmp_path_factory):
    torch.manual_seed(0)
    encoder = ColBERTEncoder(str(shared_dir / "models" / "bert-tiny-splade"), dim=16, query_maxlen=12,
                             doc_maxlen=40)
    folder = tmp_path_factory.mktemp("hub") / "export"
    return export_model(encoder, folder, extra={"global_step": 1234, "training": {"loss": {"name": "pairwise_ce"},
                                                                                   "regularizer": None},
                                                "data": {"triples": "msmarco/triples.train.small.tsv"}})


def metrics_file(folder, dataset: str, ndcg: float):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "metrics.json"
    path.write_text(json.dumps({"dataset": {"name": dataset, "split": "test"},
                                "results": {"bm25": {"metrics": {"ndcg@10": 0.5, "recall@100": 0.7}},
                                            "colbert": {"metrics": {"ndcg@10": ndcg, "recall@100": 0.9},
                                                        "mode": "full"}}}))
    return path


def test_model_card_carries_base_settings_training_and_figures(export, tmp_path):
    card = model_card(export, [metrics_file(tmp_path / "a", "scifact", 0.61234),
                               metrics_file(tmp_path / "b", "nfcorpus", 0.31)], repo_id="me/tiny-colbert")
    assert card.startswith("---\nlibrary_name: hil\n")
    assert "# me/tiny-colbert" in card
    assert "| doc_maxlen | `40` |" in card and "| dim | `16` |" in card
    assert "- steps: 1234" in card and "msmarco/triples.train.small.tsv" in card and "pairwise_ce" in card
    assert "| scifact (test) | colbert | 0.6123 | 0.9000 |" in card
    assert "| nfcorpus (test) | bm25 | 0.5000 | 0.7000 |" in card
    assert "Stanford ColBERT checkpoint" in card  # a ColBERT export carries the Stanford layout too


def test_bad_metrics_file_is_one_clear_error(export, tmp_path):
    bad = tmp_path / "metrics.json"
    bad.write_text(json.dumps({"dataset": "x"}))
    with pytest.raises(HubError, match="metrics.json: not a metrics.json written by evaluate.py"):
        model_card(export, [bad])
    with pytest.raises(HubError, match="no such metrics file"):
        model_card(export, [tmp_path / "none.json"])


class FakeHub:
    """Records what a push sends: the repository made and a copy of the uploaded folder."""

    def __init__(self, into):
        self.into, self.calls = into, []

    def create_repo(self, repo_id, *, private, exist_ok, token=None):
        self.calls.append(("create_repo", repo_id, private, exist_ok))

    def upload_folder(self, *, repo_id, folder_path, commit_message, token=None):
        import shutil

        shutil.copytree(folder_path, self.into / repo_id.replace("/", "__"))
        self.calls.append(("upload_folder", repo_id))


def test_push_uploads_the_export_with_its_card_and_leaves_the_export_alone(export, tmp_path):
    before = sorted(p.name for p in export.iterdir())
    hub = FakeHub(tmp_path / "hub")
    push_to_hub(export, "me/tiny-colbert", [metrics_file(tmp_path / "m", "scifact", 0.5)], api=hub,
                staging_dir=tmp_path / "staging")
    assert hub.calls == [("create_repo", "me/tiny-colbert", False, True), ("upload_folder", "me/tiny-colbert")]
    uploaded = tmp_path / "hub" / "me__tiny-colbert"
    assert sorted(p.name for p in uploaded.iterdir()) == sorted([*before, "README.md"])
    assert "| scifact (test) | colbert | 0.5000 |" in (uploaded / "README.md").read_text()
    assert (uploaded / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    assert sorted(p.name for p in export.iterdir()) == before
    # What was uploaded loads back as the same model.
    from hil.modeling.loading import load_encoder

    assert torch.equal(load_encoder(uploaded).linear.weight, load_encoder(export).linear.weight)


def test_push_refuses_a_bad_repo_id_or_a_folder_that_is_no_export(export, tmp_path):
    with pytest.raises(HubError, match="expected 'user-or-org/name'"):
        push_to_hub(export, "no-owner", api=FakeHub(tmp_path))
    with pytest.raises(HubError, match="not a hil export"):
        push_to_hub(tmp_path, "me/x", api=FakeHub(tmp_path))


def test_a_hub_name_that_cannot_be_fetched_is_one_line(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(HubError) as error:
        local_model_dir("colbert-ir/colbertv2.0")
    assert "colbert-ir/colbertv2.0: not a local model folder" in str(error.value)
    assert "\n" not in str(error.value)
