"""Plain numpy references for the advantage estimators and RL losses, and random inputs.

The references are deliberately written as explicit Python loops over rows and
tokens, following the textbook definitions, so they share no code path (and no
vectorisation trick) with the torch implementations under test.
"""

from __future__ import annotations

import math

import numpy as np
import torch

AGG_MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
SEEDS = [0, 1, 2]


# ---------------------------------------------------------------------------
# Random inputs
# ---------------------------------------------------------------------------


def make_mask(rng: np.random.Generator, B: int, T: int, holes: bool = True, empty_row: bool = False) -> np.ndarray:
    """Right-padded 0/1 mask with unequal lengths and optional interior holes."""
    mask = np.zeros((B, T))
    for b in range(B):
        length = int(rng.integers(1, T + 1))
        if b == 0:
            length = T  # guarantee one full row
        if b == 1:
            length = 1  # and one single-token row
        for t in range(length):
            mask[b, t] = 1.0
        if holes and length >= 4 and rng.random() < 0.6:
            mask[b, int(rng.integers(1, length - 1))] = 0.0
    if empty_row:
        mask[B - 1, :] = 0.0
    return mask


def make_groups(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled, non-contiguous group ids with sizes 1..5 (incl. a singleton)."""
    sizes = [1, 2, 3, 5, 4, 1, 3]
    ids = []
    for g, size in enumerate(sizes):
        ids += [g * 7 + 3] * size  # non-contiguous ids
    ids = np.array(ids)
    rng.shuffle(ids)
    rewards = rng.normal(size=len(ids)) * 2.0 + 0.5
    # a group with identical rewards (zero std)
    same = ids == ids[0]
    rewards[same] = 1.0
    return rewards, ids


def t64(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------------------
# numpy references (loops only)
# ---------------------------------------------------------------------------


def np_grpo(rewards, ids, normalize_std, eps):
    out = np.zeros(len(rewards))
    for g in set(ids.tolist()):
        members = [i for i in range(len(ids)) if ids[i] == g]
        n = len(members)
        if n == 1:
            out[members[0]] = 0.0
            continue
        mean = sum(rewards[i] for i in members) / n
        var = sum((rewards[i] - mean) ** 2 for i in members) / (n - 1)
        for i in members:
            a = rewards[i] - mean
            out[i] = a / (math.sqrt(var) + eps) if normalize_std else a
    return out


def np_whiten_list(values, eps):
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return [(v - mean) / math.sqrt(var + eps) for v in values]


def np_rpp_baseline(rewards, ids, eps):
    centred = np_grpo(rewards, ids, normalize_std=False, eps=0.0)
    return np.array(np_whiten_list(list(centred), eps))


def valid_positions(mask_row):
    return [t for t in range(len(mask_row)) if mask_row[t] != 0]


def np_returns_rpp(token_rewards, kl, mask, gamma, kl_coef, eps):
    B, T = mask.shape
    ret = np.zeros((B, T))
    for b in range(B):
        g = 0.0
        for t in reversed(valid_positions(mask[b])):
            g = (token_rewards[b, t] - kl_coef * kl[b, t]) + gamma * g
            ret[b, t] = g
    flat = [ret[b, t] for b in range(B) for t in valid_positions(mask[b])]
    white = np_whiten_list(flat, eps)
    out = np.zeros((B, T))
    k = 0
    for b in range(B):
        for t in valid_positions(mask[b]):
            out[b, t] = white[k]
            k += 1
    return out


def np_gae(rewards, values, mask, gamma, lam):
    B, T = mask.shape
    adv = np.zeros((B, T))
    ret = np.zeros((B, T))
    for b in range(B):
        next_v, next_a = 0.0, 0.0
        for t in reversed(valid_positions(mask[b])):
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            a = delta + gamma * lam * next_a
            adv[b, t] = a
            ret[b, t] = a + values[b, t]
            next_v, next_a = values[b, t], a
    return adv, ret


def np_kl(lp, ref, kind):
    out = np.zeros_like(lp)
    for idx in np.ndindex(lp.shape):
        d = lp[idx] - ref[idx]
        if kind == "k1":
            out[idx] = d
        elif kind == "k2":
            out[idx] = 0.5 * d * d
        else:
            r = math.exp(ref[idx] - lp[idx])
            k3 = r - 1.0 - math.log(r)
            out[idx] = min(max(k3, -10.0), 10.0) if kind == "low_var_kl" else k3
    return out


def np_agg_weights(mask, mode):
    """w such that aggregate(x) == sum(w * x)."""
    B, T = mask.shape
    w = np.zeros((B, T))
    n_tokens = sum(1 for b in range(B) for t in range(T) if mask[b, t])
    n_seqs = sum(1 for b in range(B) if any(mask[b]))
    for b in range(B):
        pos = valid_positions(mask[b])
        for t in pos:
            if mode == "token_mean":
                w[b, t] = 1.0 / n_tokens
            elif mode == "seq_mean_token_mean":
                w[b, t] = 1.0 / (n_seqs * len(pos))
            else:
                w[b, t] = 1.0 / n_seqs
    return w


def np_agg(x, mask, mode):
    B, T = mask.shape
    if mode == "token_mean":
        tot, n = 0.0, 0
        for b in range(B):
            for t in valid_positions(mask[b]):
                tot += x[b, t]
                n += 1
        return tot / n
    per_seq = []
    for b in range(B):
        pos = valid_positions(mask[b])
        if not pos:
            continue
        s = sum(x[b, t] for t in pos)
        per_seq.append(s / len(pos) if mode == "seq_mean_token_mean" else s)
    return sum(per_seq) / len(per_seq)


def np_tis(old, roll, mask, lo, hi, level, mode):
    B, T = mask.shape
    w = np.zeros((B, T))
    for b in range(B):
        pos = valid_positions(mask[b])
        seq_log = sum(old[b, t] - roll[b, t] for t in pos)
        for t in pos:
            raw = math.exp(seq_log) if level == "sequence" else math.exp(old[b, t] - roll[b, t])
            if mode == "truncate":
                w[b, t] = min(max(raw, lo), hi)
            else:
                w[b, t] = raw if lo <= raw <= hi else 0.0
    return w


def np_ppo_token(ratio, a, eps_lo, eps_hi, c):
    """Returns (loss, dloss/dratio) for one token."""
    l1 = -a * ratio
    clipped_ratio = min(max(ratio, 1 - eps_lo), 1 + eps_hi)
    l2 = -a * clipped_ratio
    if l1 >= l2:
        loss, d = l1, -a
    else:
        loss, d = l2, 0.0
    if c is not None and a < 0 and -a * c < loss:
        loss, d = -a * c, 0.0
    return loss, d


def np_policy(lp, old, adv, mask, *, loss_type, eps_lo, eps_hi, c, tis_w, mode):
    """numpy loss and its analytic gradient w.r.t. lp (stop-gradients honoured)."""
    B, T = mask.shape
    per_tok = np.zeros((B, T))
    dper = np.zeros((B, T))  # d per_token / d lp (already including chain rule)
    for b in range(B):
        pos = valid_positions(mask[b])
        if not pos:
            continue
        s = math.exp(sum(lp[b, t] - old[b, t] for t in pos) / len(pos))
        for t in pos:
            if loss_type == "ppo":
                ratio = math.exp(lp[b, t] - old[b, t])
                loss, dr = np_ppo_token(ratio, adv[b, t], eps_lo, eps_hi, c)
                per_tok[b, t], dper[b, t] = loss, dr * ratio
            elif loss_type == "gspo":
                loss, dr = np_ppo_token(s, adv[b, t], eps_lo, eps_hi, c)
                # token form: d s_{i,t} / d lp_t = s_i
                per_tok[b, t], dper[b, t] = loss, dr * s
            else:
                ratio = math.exp(lp[b, t] - old[b, t])
                w = min(max(ratio, 1 - eps_lo), 1 + eps_hi)
                per_tok[b, t] = -w * adv[b, t] * lp[b, t]
                dper[b, t] = -w * adv[b, t]
    per_tok = per_tok * tis_w
    dper = dper * tis_w
    aw = np_agg_weights(mask, mode)
    return np_agg(per_tok, mask, mode), aw * dper


def np_value_loss(values, old_values, returns, mask, clip, mode):
    B, T = mask.shape
    per = np.zeros((B, T))
    for b in range(B):
        for t in valid_positions(mask[b]):
            e1 = (values[b, t] - returns[b, t]) ** 2
            if clip is None:
                per[b, t] = 0.5 * e1
            else:
                vc = old_values[b, t] + min(max(values[b, t] - old_values[b, t], -clip), clip)
                e2 = (vc - returns[b, t]) ** 2
                per[b, t] = 0.5 * max(e1, e2)
    return np_agg(per, mask, mode)


def np_entropy(logits):
    shape = logits.shape[:-1]
    out = np.zeros(shape)
    for idx in np.ndindex(shape):
        z = logits[idx]
        m = max(z)
        exps = [math.exp(v - m) for v in z]
        tot = sum(exps)
        h = 0.0
        for v, e in zip(z, exps):
            p = e / tot
            logp = (v - m) - math.log(tot)
            h -= p * logp
        out[idx] = h
    return out


def np_logprobs(logits, labels):
    shape = logits.shape[:-1]
    out = np.zeros(shape)
    for idx in np.ndindex(shape):
        z = logits[idx]
        m = max(z)
        lse = m + math.log(sum(math.exp(v - m) for v in z))
        out[idx] = z[labels[idx]] - lse
    return out


def central_diff(f, x, mask, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        if not mask[idx]:
            continue
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (f(xp) - f(xm)) / (2 * h)
    return g
