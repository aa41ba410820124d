"""Checkpoints written as Stanford ColBERT and PyLate write them, and scores computed as they compute them.

Nothing here imports ``hil``: the writers follow the peers' own save paths (Stanford: ``HF_ColBERT.save_pretrained``
-- backbone under ``bert.``, ``linear.weight``, ``config.json`` architectures ``HF_ColBERT`` -- plus
``ColBERTConfig.save`` for ``artifact.metadata``; PyLate: ``ColBERT.save`` -- ``modules.json``, the Transformer with
its added prefix tokens, ``1_Dense``, ``config_sentence_transformers.json``), and the references re-do the peers'
tokenization (Stanford's ``". " + text`` then marker substitution; PyLate's prefix insertion after ``[CLS]`` with
``[MASK]`` as the pad token), the projection, normalization and MaxSim, written the slow, obvious way.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModel, AutoTokenizer

TRANSFORMER_TYPE = "sentence_transformers.models.Transformer"
PYLATE_DENSE_TYPE = "pylate.models.Dense.Dense"


def _projection(hidden: int, dim: int, seed: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(dim, hidden, generator=generator) * 0.05
    return weight, (torch.randn(dim, generator=generator) * 0.05 if bias else None)


def write_stanford(folder: Path, backbone: str, *, dim: int = 24, seed: int = 0, metadata: dict | None = None,
                   with_metadata: bool = True) -> Path:
    folder.mkdir(parents=True)
    model = AutoModel.from_pretrained(backbone)  # HF_ColBERT builds the base model with its pooler
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    weight, _ = _projection(model.config.hidden_size, dim, seed, False)
    state = {f"bert.{k}": v.clone().contiguous() for k, v in model.state_dict().items()}
    state["linear.weight"] = weight
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["HF_ColBERT"]
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer.save_pretrained(folder)
    if with_metadata:
        values = {"query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_token": "[Q]",
                  "doc_token": "[D]", "ncells": None, "nbits": 2, "kmeans_niters": 4, "bsize": 32, "lr": 3e-6,
                  "query_maxlen": 12, "doc_maxlen": 40, "dim": dim, "mask_punctuation": True,
                  "attend_to_mask_tokens": False, "similarity": "cosine", "interaction": "colbert",
                  "checkpoint": "colbert-ir/colbertv2.0", **(metadata or {})}
        values["meta"] = {"hostname": "test", "git_branch": "main", "version": "colbert-v0.4"}
        (folder / "artifact.metadata").write_text(json.dumps(values, indent=4), encoding="utf-8")
    return folder


def write_pylate(folder: Path, backbone: str, *, dim: int = 24, seed: int = 0, bias: bool = False,
                 settings: dict | None = None, dense: list[dict] | None = None) -> Path:
    """A PyLate ColBERT built from a plain backbone and saved: prefixes added to the vocabulary, one Dense layer."""
    folder.mkdir(parents=True)
    model = AutoModel.from_pretrained(backbone, add_pooling_layer=False)
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    config = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 12, "document_length": 40,
              "attend_to_expansion_tokens": False, "skiplist_words": list(string.punctuation),
              "do_query_expansion": True, "similarity_fn_name": "MaxSim", "prompts": {"query": "", "document": ""},
              "default_prompt_name": None, **(settings or {})}
    tokenizer.add_tokens([config["query_prefix"], config["document_prefix"]])
    torch.manual_seed(seed)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 39, "do_lower_case": False}))
    layers = dense or [{"bias": bias}]
    modules = [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER_TYPE}]
    in_features = model.config.hidden_size
    for i, layer in enumerate(layers, start=1):
        out = layer.get("out_features", dim)
        weight, layer_bias = _projection(in_features, out, seed + i, layer.get("bias", False))
        sub = folder / f"{i}_Dense"
        sub.mkdir()
        tensors = {"linear.weight": weight, **({"linear.bias": layer_bias} if layer_bias is not None else {})}
        save_file(tensors, str(sub / "model.safetensors"), metadata={"format": "pt"})
        (sub / "config.json").write_text(json.dumps(
            {"in_features": in_features, "out_features": out, "bias": layer_bias is not None,
             "activation_function": layer.get("activation", "torch.nn.modules.linear.Identity"),
             "use_residual": layer.get("use_residual", False)}))
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Dense", "type": PYLATE_DENSE_TYPE})
        in_features = out
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    return folder


def _maxsim(queries: list[torch.Tensor], docs: list[torch.Tensor]) -> torch.Tensor:
    scores = torch.zeros(len(queries), len(docs))
    for i, q in enumerate(queries):
        for j, d in enumerate(docs):
            scores[i, j] = sum(max(float(q[a] @ d[b]) for b in range(len(d))) for a in range(len(q)))
    return scores


def stanford_reference(folder: Path, queries: list[str], docs: list[str]) -> torch.Tensor:
    """Scores as Stanford ColBERT v2 computes them (QueryTokenizer / DocTokenizer / ColBERT.query / ColBERT.doc)."""
    meta = json.loads((folder / "artifact.metadata").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bert = AutoModel.from_pretrained(folder, add_pooling_layer=False).eval()
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        weight = handle.get_tensor("linear.weight")
    q_id, d_id = tokenizer.convert_tokens_to_ids([meta["query_token_id"], meta["doc_token_id"]])
    q = tokenizer([". " + t for t in queries], padding="max_length", truncation=True,
                  max_length=meta["query_maxlen"], return_tensors="pt")
    q_ids = q["input_ids"].clone()
    q_ids[:, 1] = q_id
    q_ids[q_ids == tokenizer.pad_token_id] = tokenizer.mask_token_id
    q_mask = q["attention_mask"].clone()
    if meta.get("attend_to_mask_tokens"):
        q_mask[q_ids == tokenizer.mask_token_id] = 1
    d = tokenizer([". " + t for t in docs], padding="longest", truncation=True, max_length=meta["doc_maxlen"],
                  return_tensors="pt")
    d_ids = d["input_ids"].clone()
    d_ids[:, 1] = d_id
    skip = {w for symbol in string.punctuation
            for w in (symbol, tokenizer.encode(symbol, add_special_tokens=False)[0])}
    with torch.no_grad():
        Q = F.normalize(bert(input_ids=q_ids, attention_mask=q_mask).last_hidden_state @ weight.T, dim=-1)
        D = bert(input_ids=d_ids, attention_mask=d["attention_mask"]).last_hidden_state @ weight.T
    keep = [[(x not in skip or not meta["mask_punctuation"]) and x != tokenizer.pad_token_id for x in row]
            for row in d_ids.tolist()]
    D = F.normalize(D, dim=-1)
    return _maxsim(list(Q), [D[i][torch.tensor(k)] for i, k in enumerate(keep)])


def pylate_reference(folder: Path, queries: list[str], docs: list[str]) -> torch.Tensor:
    """Scores as PyLate computes them (ColBERT.tokenize / encode / Dense / MaxSim)."""
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    modules = json.loads((folder / "modules.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token_id = tokenizer.mask_token_id  # PyLate pads with [MASK] (query expansion)
    bert = AutoModel.from_pretrained(folder, add_pooling_layer=False).eval()
    from safetensors import safe_open

    layers = []
    for module in modules[1:]:
        with safe_open(str(folder / module["path"] / "model.safetensors"), framework="pt") as handle:
            keys = set(handle.keys())
            layers.append((handle.get_tensor("linear.weight"),
                           handle.get_tensor("linear.bias") if "linear.bias" in keys else None))

    def project(hidden: torch.Tensor) -> torch.Tensor:
        for weight, bias in layers:  # one Dense after another, as PyLate applies its modules
            hidden = hidden @ weight.T + (bias if bias is not None else 0)
        return hidden

    def tokenize(texts: list[str], is_query: bool) -> dict[str, torch.Tensor]:
        length = config["query_length"] if is_query else config["document_length"]
        out = tokenizer(texts, padding="max_length" if is_query else True, truncation=True, max_length=length - 1,
                        return_tensors="pt")
        prefix = tokenizer.convert_tokens_to_ids(config["query_prefix"] if is_query else config["document_prefix"])

        def insert(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([t[:, :1], torch.full((t.shape[0], 1), value, dtype=t.dtype), t[:, 1:]], dim=1)

        out = {"input_ids": insert(out["input_ids"], prefix), "attention_mask": insert(out["attention_mask"], 1),
               "token_type_ids": insert(out["token_type_ids"], 0)}
        if is_query and config["attend_to_expansion_tokens"]:
            out["attention_mask"].fill_(1)
        return out

    q, d = tokenize(queries, True), tokenize(docs, False)
    with torch.no_grad():
        Q = project(bert(**q).last_hidden_state)
        D = project(bert(**d).last_hidden_state)
    skiplist = torch.tensor([tokenizer.convert_tokens_to_ids(w) for w in config["skiplist_words"]], dtype=torch.long)
    d_keep = d["attention_mask"].bool() & ~torch.isin(d["input_ids"], skiplist)
    queries_out = [F.normalize(row, dim=-1) for row in Q]
    docs_out = [F.normalize(D[i][d_keep[i]], dim=-1) for i in range(len(docs))]
    return _maxsim(queries_out, docs_out)
