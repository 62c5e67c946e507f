"""Reference outputs of Hugging Face's own implementations for tests/text_test.cpp.

  reference.py tokenize TOKENIZER_JSON OUT_JSONL IN_JSONL...   ids of every "review"/"text" field
  reference.py tiny-bert OUT_DIR                               random 2-layer BERT/DistilBERT + logits
  reference.py export-check FOLDER TEXTS_CSV PREDICTIONS_CSV POOLING MAX_LENGTH [multilabel]
                                  transformers on `engine export`'s folder == engine predict's probabilities
                                  (multilabel: each label's sigmoid, and problem_type in the config)
  reference.py length-grouped LENGTHS_FILE BATCH SPLIT_SEED SEED EPOCHS
                                  per epoch, each batch's longest length in transformers' length-grouped order
"""
import json
import pathlib
import sys


def tokenize(tokenizer_json, out, inputs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    with open(out, "w", encoding="utf-8") as f:
        for path in inputs:
            for line in open(path, encoding="utf-8"):
                if not line.strip():
                    continue
                row = json.loads(line)
                text = row["review"] if "review" in row else row["text"]
                f.write(json.dumps(tok.encode(text).ids) + "\n")


def tiny_bert(out_dir):
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertForSequenceClassification, DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    out = pathlib.Path(out_dir)
    ids = torch.randint(5, 100, (3, 7))
    ids[:, 0] = 1
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padded rows
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    cases = {}
    for kind in ("bert", "distilbert"):
        if kind == "bert":
            cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=48, max_position_embeddings=16, num_labels=3)
            model = BertForSequenceClassification(cfg)
        else:
            cfg = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                   max_position_embeddings=16, num_labels=3)
            model = DistilBertForSequenceClassification(cfg)
        model.eval()
        # Non-trivial LayerNorm and bias values, so a swapped or skipped tensor changes the logits.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "LayerNorm" in name or "layer_norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        folder = out / kind
        folder.mkdir(parents=True, exist_ok=True)
        cfg.to_json_file(folder / "config.json")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
        with torch.no_grad():
            pooler_logits = model(input_ids=ids, attention_mask=mask).logits
            base = model.bert if kind == "bert" else model.distilbert
            hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).float()
            mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            mean_logits = model.classifier(mean)
        cases[kind] = {"pooler": pooler_logits.tolist(), "mean": mean_logits.tolist()}
    json.dump({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "logits": cases},
              open(out / "reference.json", "w"))


def export_check(folder, texts_csv, predictions_csv, pooling, max_length, mode="single"):
    """The folder `engine export` wrote loads in transformers (model, config, tokenizer) and gives
    the probabilities `engine predict` wrote for every text, to 1e-5. Multi-label: the sigmoid of
    each label's logit (transformers' problem_type = "multi_label_classification", which its
    sequence-classification models train with BCEWithLogitsLoss)."""
    multilabel = mode == "multilabel"
    prefix = "out_" if multilabel else "prob_"
    import csv
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    with open(texts_csv, newline="") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    with open(predictions_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(texts), (len(rows), len(texts))
    columns = [k for k in rows[0] if k.startswith(prefix)]  # in class-id order, as predict writes them
    want = torch.tensor([[float(r[k]) for k in columns] for r in rows])
    # The config names the classes as the data did (pipelines print these names).
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    if config.problem_type != ("multi_label_classification" if multilabel else "single_label_classification"):
        sys.exit(f"config.json's problem_type is {config.problem_type}")
    id2label = config.id2label
    names = [id2label[i] for i in range(len(columns))]
    if names != [k[len(prefix):] for k in columns]:
        sys.exit(f"config.json's id2label {names} is not the data's classes {columns}")
    tok = AutoTokenizer.from_pretrained(folder)
    if pooling == "pooler":
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    else:
        from safetensors.torch import load_file
        model = AutoModel.from_pretrained(folder).eval()
        head = load_file(pathlib.Path(folder) / "model.safetensors")
    got = []
    with torch.no_grad():
        for text in texts:
            enc = tok(text, truncation=True, max_length=int(max_length), return_tensors="pt")
            if pooling == "pooler":
                logits = model(**enc).logits
            else:
                hidden = model(**enc).last_hidden_state
                m = enc["attention_mask"].unsqueeze(-1).float()
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                logits = pooled @ head["classifier.weight"].T + head["classifier.bias"]
            got.append(logits.sigmoid()[0] if multilabel else logits.softmax(-1)[0])
    got = torch.stack(got)
    diff = (got - want).abs().max().item()
    print(f"{len(texts)} texts, largest probability difference {diff:.2e}")
    if diff > 1e-5:
        sys.exit(f"transformers on the export differs from engine predict by {diff}")


def length_grouped(lengths_file, batch_size, split_seed, seed, epochs):
    """Per epoch, one line: the longest length of each batch of transformers' length-grouped order
    (get_length_grouped_indices, as a Trainer with group_by_length orders an epoch) over the training
    split text_classification makes of lengths_file (one length per text, in file order) with
    val_split = 0: a randperm seeded with trainer.seed; the epoch's generator is seeded as Ember
    seeds its shuffle (seed * 1000003 + epoch + 1)."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices
    lengths = [int(x) for x in open(lengths_file).read().split()]
    bs = int(batch_size)
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(int(split_seed))).tolist()
    train = [lengths[i] for i in perm]
    for epoch in range(int(epochs)):
        g = torch.Generator().manual_seed(int(seed) * 1000003 + epoch + 1)
        order = get_length_grouped_indices(train, bs, generator=g)
        print(" ".join(str(max(train[i] for i in order[b:b + bs])) for b in range(0, len(order), bs)))


if __name__ == "__main__":
    if sys.argv[1] == "tokenize":
        tokenize(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "tiny-bert":
        tiny_bert(sys.argv[2])
    elif sys.argv[1] == "export-check":
        export_check(*sys.argv[2:8])
    elif sys.argv[1] == "length-grouped":
        length_grouped(*sys.argv[2:7])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
