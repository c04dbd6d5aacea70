"""KV-cache compaction: after verifying a tree and keeping one path, the cache is the cache of
running the accepted tokens one after another (causally), layer by layer."""
from __future__ import annotations

import random

import pytest
import torch

from eagle2_core.kvcache import TreeKVCache, TreeKVLayer, num_cache_layers
from eagle2_core.target import TargetRunner
from eagle2_core.tree import tree_from_parents

from conftest import CORE_ARCHS

VOCAB = 12


def random_tree(rng: random.Random, n: int) -> torch.Tensor:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    return tree_from_parents(torch.tensor(tokens), torch.tensor(parents))


def root_path(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def assert_same_cache(a: TreeKVCache, b: TreeKVCache, length: int) -> None:
    assert a.length == b.length == length
    for la, lb in zip(a.layers, b.layers):
        assert la.get_seq_length() == length
        torch.testing.assert_close(la.keys[:, :, :length], lb.keys[:, :, :length], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(la.values[:, :, :length], lb.values[:, :, :length], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", CORE_ARCHS)
@pytest.mark.parametrize("seed", range(3))
def test_keep_equals_sequential_cache(tiny_lm, arch, seed):
    """Prefix (longer than the sliding windows), then a random 12-node tree verified in one forward,
    then `keep` of a random root-to-node path: every layer's keys/values equal those of a fresh
    cache that ran prefix + path tokens causally; the path nodes' hidden states equal the
    sequential ones; and decoding continues identically from both caches."""
    rng = random.Random(100 * seed + CORE_ARCHS.index(arch))
    model = tiny_lm(arch, vocab_size=VOCAB, max_position_embeddings=64)
    run = TargetRunner(model)
    n_layers = num_cache_layers(model.config)
    prefix = torch.tensor([rng.randrange(VOCAB) for _ in range(rng.randint(6, 11))])
    past = prefix.numel()
    with torch.no_grad():
        cache = TreeKVCache(n_layers, capacity=4)  # small: the buffers must grow and keep their contents
        run.forward(prefix, torch.arange(past), None, cache)
        tree = random_tree(rng, 12)
        hidden = run.forward(tree.tokens, past + tree.depth, run.tree_mask(tree, past), cache)
        assert cache.length == past + tree.size
        leaf = max(range(tree.size), key=lambda i: (int(tree.depth[i]), rng.random()))  # a deepest node
        node = rng.choice([leaf, leaf, rng.randrange(tree.size)])
        path = root_path(tree.parents.tolist(), node)
        cache.keep(past, torch.tensor(path))

        seq = torch.cat([prefix, tree.tokens[path]])
        fresh = TreeKVCache(n_layers, capacity=128)
        seq_hidden = run.forward(seq, torch.arange(seq.numel()), None, fresh)
        assert_same_cache(cache, fresh, seq.numel())
        torch.testing.assert_close(hidden[path], seq_hidden[past:], rtol=1e-4, atol=1e-5)

        nxt = torch.tensor([rng.randrange(VOCAB)])
        a = run.logits(run.forward(nxt, torch.tensor([seq.numel()]), None, cache))
        b = run.logits(run.forward(nxt, torch.tensor([seq.numel()]), None, fresh))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert_same_cache(cache, fresh, seq.numel() + 1)
    print(f"\n[kvcache] {arch} seed={seed}: prefix {past}, tree 12 nodes, kept path {path} (depth {len(path) - 1})")


def _layer_with_positions(n: int, capacity: int) -> TreeKVLayer:
    layer = TreeKVLayer(capacity)
    pos = torch.arange(n, dtype=torch.float32)
    k = pos.view(1, 1, n, 1).expand(1, 2, n, 3).clone()
    layer.update(k, -k)
    return layer


def test_layer_keep_moves_entries_and_cuts():
    layer = _layer_with_positions(10, capacity=16)
    layer.keep(4, torch.tensor([0, 2, 3, 5]))  # overlapping source and destination ranges
    assert layer.get_seq_length() == 8
    assert layer.keys[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 7, 9]
    assert layer.values[0, 1, :8, 2].tolist() == [-0.0, -1, -2, -3, -4, -6, -7, -9]
    layer.keep(8, torch.tensor([0]))  # only the root
    assert layer.get_seq_length() == 9
    layer.keep(0, torch.arange(3))  # identity prefix
    assert layer.get_seq_length() == 3 and layer.keys[0, 0, :3, 0].tolist() == [0, 1, 2]


def test_layer_growth_crop_and_truncate():
    layer = _layer_with_positions(3, capacity=2)  # first update already exceeds the capacity
    assert layer.capacity >= 3 and layer.get_seq_length() == 3
    k = torch.full((1, 2, 5, 3), 7.0)
    keys, values = layer.update(k, k)
    assert keys.shape[2] == 8 and layer.capacity >= 8
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 7, 7, 7, 7, 7]
    layer.crop(2)
    assert layer.get_seq_length() == 6 and layer.get_mask_sizes(3) == (9, 0)
    cache = TreeKVCache(2, capacity=4)
    assert cache.length == 0
    cache.keep(0, torch.tensor([0]))  # uninitialised layers: a no-op
    for lay in cache.layers:
        lay.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))
    cache.truncate(3)
    assert cache.length == 3 and all(lay.length == 3 for lay in cache.layers)
    cache.truncate(10)  # never lengthens
    assert cache.length == 3
