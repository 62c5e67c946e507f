"""Reference outputs of Hugging Face transformers for tests/lm_test.cpp (the gpt model).

  reference.py tiny-models OUT_DIR      random GPT-2 and Llama (grouped-query) models saved with
                                        save_pretrained, and their logits on fixed ids (reference.json)
  reference.py logits FOLDER IDS_JSON OUT_JSON
                                        transformers' logits for the ids, from a folder (e.g. `engine export`'s)
  reference.py peft-logits BASE ADAPTERS IDS_JSON OUT_JSON
                                        PEFT's logits for the ids: the base folder with the adapter folder
                                        (`engine export --format peft`) loaded onto it
  reference.py bytelevel-bpe CORPUS_DIR VOCAB OUT_DIR
                                        a GPT-2-style byte-level BPE trained with `tokenizers` on the corpus
                                        (OUT_DIR/tokenizer.json) and its ids for every file in path order (ids.json)
  reference.py sentencepiece-ids MODEL CORPUS OUT_JSON
                                        Python sentencepiece's ids for the corpus, line by line with the
                                        newline's byte token <0x0A> between lines (text_lm's layout)
"""
import json
import pathlib
import sys


def perturb(model):
    # Non-trivial norm weights and biases, so a swapped or skipped tensor changes the logits.
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)


def tiny_models(out_dir):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = pathlib.Path(out_dir)
    ids = torch.randint(0, 96, (2, 11))
    cases = {}
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=24,
                                           bos_token_id=0, eos_token_id=0)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=48, max_position_embeddings=24,
                                              rope_theta=500.0, bos_token_id=0, eos_token_id=0, pad_token_id=None)),
        "llama_tied": LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=40, max_position_embeddings=24, tie_word_embeddings=True,
                                                   bos_token_id=0, eos_token_id=0, pad_token_id=None)),
    }
    for name, model in models.items():
        model.eval()
        perturb(model)
        folder = out / name
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            cases[name] = model(input_ids=ids).logits.tolist()
    json.dump({"input_ids": ids.tolist(), "logits": cases}, open(out / "reference.json", "w"))


def logits(folder, ids_json, out_json):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    ids = torch.tensor(json.load(open(ids_json)))
    with torch.no_grad():
        out = model(input_ids=ids).logits
    json.dump({"architecture": type(model).__name__, "logits": out.tolist()}, open(out_json, "w"))


def peft_logits(base, adapters, ids_json, out_json):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters)
    model.eval()
    ids = torch.tensor(json.load(open(ids_json)))
    with torch.no_grad():
        out = model(input_ids=ids).logits
    # The adapter weights PEFT holds after loading: zero lora_B would mean nothing was loaded.
    lora_b = [p.abs().max().item() for n, p in model.named_parameters() if "lora_B" in n]
    json.dump({"architecture": type(model.get_base_model()).__name__, "logits": out.tolist(), "lora_b_max": lora_b},
              open(out_json, "w"))


def bytelevel_bpe(corpus_dir, vocab, out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(p for p in pathlib.Path(corpus_dir).rglob("*") if p.is_file() and not p.name.startswith("."))
    texts = [p.read_text(encoding="utf-8") for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab), special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = []
    for text in texts:
        ids += tok.encode(text).ids
    json.dump({"ids": ids, "vocab_size": tok.get_vocab_size()}, open(out / "ids.json", "w"))


def sentencepiece_ids(model, corpus, out_json):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    newline = sp.piece_to_id("<0x0A>")
    ids = []
    lines = open(corpus, encoding="utf-8").read().split("\n")
    for i, line in enumerate(lines):
        if line:
            ids += sp.encode(line)
        if i + 1 < len(lines):
            ids.append(newline)
    json.dump({"ids": ids, "vocab_size": sp.get_piece_size()}, open(out_json, "w"))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "tiny-models":
        tiny_models(sys.argv[2])
    elif cmd == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "peft-logits":
        peft_logits(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    elif cmd == "bytelevel-bpe":
        bytelevel_bpe(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "sentencepiece-ids":
        sentencepiece_ids(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {cmd}")
