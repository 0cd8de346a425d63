#!/usr/bin/env python3
"""Evaluate refcoder (or a train.py checkpoint) on held-out text: loss, perplexity, top-1 and, for every
early exit E (shared final norm + lm_head applied to the hidden state after block E), the agreement of its
top-1 with the full model's top-1.  Same protocol as train.py: non-overlapping windows of the training
context length, last window partial, token-weighted mean, fp32.

  python3 models/refcoder/evaluate.py                           # heldout_sample.txt
  python3 models/refcoder/evaluate.py --whole-heldout           # every held-out stdlib file (needs the
                                                                # same Python stdlib as in metrics.json)
  python3 models/refcoder/evaluate.py --ckpt /tmp/refcoder_main_ckpt/last.pt --whole-heldout
"""

import argparse
import json
import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
p = argparse.ArgumentParser()
p.add_argument("--model", default=str(HERE))
p.add_argument("--ckpt", default=None, help="train.py checkpoint (.pt) whose weights replace the model's")
p.add_argument("--whole-heldout", action="store_true")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--json", default=None, help="write the result here")
args = p.parse_args()
torch.set_num_threads(args.threads)

model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, torch_dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
if args.ckpt:
    model.load_state_dict(torch.load(args.ckpt, map_location="cpu", weights_only=False)["model"])
model.eval()
metrics = json.loads((Path(args.model) / "metrics.json").read_text())
T = metrics["config"]["seq_len"]
L = model.config.num_hidden_layers
EOS = tok.eos_token

if args.whole_heldout:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = metrics["corpus"]["heldout_files"]
    text = "".join((stdlib / f).read_bytes().decode("utf-8") + EOS for f in files)
else:
    text = (Path(args.model) / "heldout_sample.txt").read_bytes().decode("utf-8")
ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
n = len(ids) - 1
wins = [(ids[i : min(i + T, n)], ids[i + 1 : min(i + T, n) + 1]) for i in range(0, n, T)]


@torch.no_grad()
def hidden_states(x):
    m = model.model
    h = m.embed_tokens(x)
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    pe = m.rotary_emb(h, pos)
    hs = []
    for layer in m.layers:
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        h = out[0] if isinstance(out, tuple) else out
        hs.append(h)
    return hs


tot, cnt, correct = 0.0, 0, 0
agree, ex_top1, ex_loss = [0] * L, [0] * L, [0.0] * L
with torch.no_grad():
    for j in range(0, len(wins), 16):
        group = wins[j : j + 16]
        if len({len(g[0]) for g in group}) == 1:
            batches = [(torch.stack([g[0] for g in group]), torch.stack([g[1] for g in group]))]
        else:
            batches = [(g[0][None], g[1][None]) for g in group]
        for x, y in batches:
            hs = hidden_states(x)
            final = model.lm_head(model.model.norm(hs[-1])).float()
            f1 = final.argmax(-1)
            tot += F.cross_entropy(final.reshape(-1, final.size(-1)), y.reshape(-1), reduction="sum").item()
            correct += (f1 == y).sum().item()
            cnt += y.numel()
            for e in range(L):
                lg = model.lm_head(model.model.norm(hs[e])).float()
                t1 = lg.argmax(-1)
                agree[e] += (t1 == f1).sum().item()
                ex_top1[e] += (t1 == y).sum().item()
                ex_loss[e] += F.cross_entropy(lg.reshape(-1, lg.size(-1)), y.reshape(-1), reduction="sum").item()

res = {
    "text": "whole held-out split" if args.whole_heldout else "heldout_sample.txt",
    "tokens": cnt,
    "loss": tot / cnt,
    "ppl": math.exp(tot / cnt),
    "top1": correct / cnt,
    "exit_agreement": {str(e + 1): agree[e] / cnt for e in range(L - 1)},
    "exit_top1": {str(e + 1): ex_top1[e] / cnt for e in range(L)},
    "exit_loss": {str(e + 1): ex_loss[e] / cnt for e in range(L)},
}
print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if not isinstance(v, dict)}))
print("exit agreement:", {k: round(v, 3) for k, v in res["exit_agreement"].items()})
if args.json:
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
