#!/usr/bin/env python3
"""Device-side check (needs the `tokenizers` package): kestrel-train tokenize against HF tokenizers.

Trains small byte-level BPE tokenizers with `tokenizers` (GPT-2 ByteLevel split, Qwen2 and Llama 3
Split regexes; merges saved in the library's own form and rewritten in the other "a b" / [a, b]
form), tokenizes random multilingual documents with `kestrel-train tokenize`, and compares every
document's ids with Tokenizer.encode. Prints one line per tokenizer and exits non-zero on a mismatch.

usage: check_bpe_vs_hf.py path/to/kestrel-train [workdir]
"""
import json
import os
import random
import struct
import subprocess
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

WORDS = ["hello", "world", "the", "café", "über", "naïve", "中文", "日本語", "привет", "مرحبا", "I'm", "DON'T",
         "we've", "it'S", "x2", "2024", "١٢٣", "3.14", "(paren)", "e-mail", "😀", "tab\there", "a\r\nb", "...", "!!"]


def random_doc(rng):
    out = []
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        if r < 0.6:
            out.append(rng.choice(WORDS))
        elif r < 0.8:
            out.append(" " * rng.randint(1, 3))
        elif r < 0.9:
            out.append(rng.choice(["\n", "\n\n", " \n", "\t", "  \n "]))
        else:
            out.append("".join(chr(rng.randint(0x20, 0x2FF)) for _ in range(rng.randint(1, 4))))
        if rng.random() < 0.7:
            out.append(" ")
    return "".join(out)


def build(kind, corpus, path):
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pattern = QWEN2 if kind == "qwen2" else LLAMA3
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(path)
    return tok


def other_merge_form(src, dst):
    j = json.load(open(src, encoding="utf-8"))
    merges = j["model"]["merges"]
    if merges and isinstance(merges[0], str):
        j["model"]["merges"] = [m.split(" ") for m in merges]
    else:
        j["model"]["merges"] = [" ".join(m) for m in merges]
    json.dump(j, open(dst, "w", encoding="utf-8"), ensure_ascii=False)


def read_tokens(path):
    data = open(path, "rb").read()
    header = struct.unpack("<256i", data[:1024])
    width = 2 if header[0] == 20240520 else 4
    n = header[2]
    return list(struct.unpack("<%d%s" % (n, "H" if width == 2 else "I"), data[1024:1024 + n * width]))


def main():
    binary = sys.argv[1]
    work = sys.argv[2] if len(sys.argv) > 2 else "/tmp/bpe_check"
    os.makedirs(work, exist_ok=True)
    rng = random.Random(7)
    corpus = [random_doc(rng) for _ in range(3000)]
    docs = [random_doc(rng) for _ in range(400)]
    with open(os.path.join(work, "docs.jsonl"), "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    failed = False
    for kind in ["gpt2", "qwen2", "llama3"]:
        tj = os.path.join(work, kind + ".json")
        hf = build(kind, corpus, tj)
        alt = os.path.join(work, kind + "_other_merges.json")
        other_merge_form(tj, alt)
        sep = hf.token_to_id("<|endoftext|>")
        want = []
        for d in docs:
            want += [sep] + hf.encode(d).ids
        for path in [tj, alt]:
            out = path + ".bin"
            p = subprocess.run([binary, "tokenize", "--tokenizer", path, "--output", out,
                                os.path.join(work, "docs.jsonl")], capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{kind} {os.path.basename(path)}: kestrel-train failed: {p.stderr.strip()}")
                failed = True
                continue
            got = read_tokens(out)
            same = got == want
            first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            print(f"bpe vs tokenizers {kind:6s} {os.path.basename(path):28s}: {len(docs)} docs, {len(want)} ids, "
                  f"{'identical' if same else 'MISMATCH at %s (len %d vs %d)' % (first_bad, len(got), len(want))}")
            failed |= not same
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
