#!/usr/bin/env python3
"""Writes the seeds of tests/fuzz/corpus/model_files/: small files of the kinds a model folder
downloaded from Hugging Face holds, made with the Python packages that write them.

usage: make_model_file_seeds.py OUT_DIR
Each seed is one kind byte (tests/fuzz/model_file_inputs.h) followed by the file's bytes:
  0 safetensors (safetensors.torch), 1 byte-level BPE tokenizer.json (tokenizers),
  2 gpt config.json (GPT2Config / LlamaConfig), 3 bert config.json (BertConfig / DistilBertConfig),
  4 WordPiece vocab.txt. Run once with the LibTorch venv's Python (scripts/setup.sh installs
  these packages there); the seeds are committed."""
import json
import os
import sys
import tempfile


def write(out_dir, name, kind, data):
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(bytes([kind]) + data)


def main():
    out = sys.argv[1]
    import torch
    from safetensors.torch import save
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import BertConfig, DistilBertConfig, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    write(out, "weights.safetensors", 0, save({
        "wte.weight": torch.randn(5, 3), "ln.bias": torch.zeros(3, dtype=torch.bfloat16),
        "steps": torch.tensor([1, 2], dtype=torch.int64), "mask": torch.tensor([True, False])},
        metadata={"format": "pt"}))

    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. 'Tis 12 o'clock; we've said it's done.\n\n  Caf\u00e9 \u00fcber \u4e2d\u6587!")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    with tempfile.TemporaryDirectory() as d:
        tok.save(os.path.join(d, "tokenizer.json"))
        write(out, "bytelevel.tokenizer.json", 1, open(os.path.join(d, "tokenizer.json"), "rb").read())

    def config(c):
        return json.dumps(c.to_dict(), indent=2, sort_keys=True).encode()

    write(out, "gpt2.config.json", 2, config(GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=95, eos_token_id=95)))
    write(out, "llama.config.json", 2, config(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)))
    write(out, "bert.config.json", 3, config(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                        intermediate_size=64)))
    write(out, "distilbert.config.json", 3, config(DistilBertConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, hidden_dim=64)))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "truth", "a", "single", "man", "##s", "##ly", "un", "##iver",
             "##sal", ",", ".", "'", "caf", "##e", "\u4e2d", "\u6587", "!", "1", "##2"]
    write(out, "vocab.txt", 4, ("\n".join(vocab) + "\n").encode())


if __name__ == "__main__":
    main()
