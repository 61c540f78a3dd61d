"""``generate()`` on a GPU: the grouped-query Llama of ``tests/fixtures/saved_models.py`` (``llama_generate``),
compiled and saved where TVM is, loaded without TVM — its weights from the folder, and again from a checkpoint into a
kernels-only save — generates on sparta's kernels with Hugging Face's static cache and decode steps replayed from CUDA
graphs."""

import pytest
import torch

from fixtures.artifacts import load_saved
from fixtures.kernel_choices import check_llama_generate

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model():
    return load_saved("saved_llama_generate")


def _greedy_reference(reference, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy tokens of the cache-free masked dense graph (recomputed from scratch each step), with each step's gap
    between its best and second-best logit."""
    ids, gaps = prompt, []
    with torch.no_grad():
        for _ in range(new):
            logits = reference(ids)[0][:, -1].float()          # the graph's flat outputs: the logits
            top = logits.topk(2, -1).values
            gaps.append(float((top[:, 0] - top[:, 1]).min()))
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids, gaps


def test_generate_replays_cuda_graphs_and_follows_the_masked_dense_model(model):
    check_llama_generate(model)
    prompt = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    got = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    # two rows: the decode steps' rotary embedding and cache write ran in the attention kernels (the rope pair), which
    # read the stacked q/k/v kernel's output in place
    assert model.decode_modules["attention"]._rope_op is not None
    graphs = model.decoder().sparta_decode_graphs
    assert graphs.replays >= 23 and len(graphs.graphs) == 1
    again = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(got, again)
    eager = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
                           disable_compile=True)
    assert torch.equal(got, eager)                       # the graphs replay exactly the eager decode steps
    want, gaps = _greedy_reference(model.reference().to("cuda"), prompt, 24)
    # bf16 kernels against torch's bf16 ops: the tokens agree until a step whose top two logits nearly tie
    first = next((i for i in range(24) if not torch.equal(got[:, 37 + i], want[:, 37 + i])), 24)
    assert first == 24 or gaps[first] < 0.1, (first, gaps[first], got, want)
    assert first >= 8, (first, gaps)


def test_a_kernels_only_save_generates_with_the_weights_of_a_checkpoint(model, tmp_path):
    import sparta
    folder = tmp_path / "kernels_only"
    model.save(folder, weights=False)
    state = model.source_reference().state_dict()         # the user's names, pruned blocks zero
    loaded = sparta.load(folder, weights=state).to("cuda")
    prompt = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1)).cuda()
    a = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    b = loaded.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    # one row: the decode steps' rotary embedding and cache write ran in the attention kernels (the rope pair)
    assert loaded.decode_modules["attention"]._rope_op is not None


def test_a_plain_greedy_call_runs_one_graph_per_token_and_gives_hugging_faces_tokens(model):
    """The default greedy call takes sparta's loop (sparta.runtime.decode_loop), for a left-padded batch, with and
    without an end-of-sequence token. Its decode steps rotate the query and key in the attention kernels (rounded once,
    where Hugging Face's loop over the same linears rounds twice), and by default Inductor fuses the norms, so its
    tokens agree with Hugging Face's loop up to a step, the first included, whose two best logits are within rounding
    of each other; a second call replays the same graphs on the same cache, token for token."""
    from sparta.runtime.decode_loop import greedy_generate
    prompt = torch.randint(3, 512, (3, 21), generator=torch.Generator().manual_seed(4)).cuda()
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=40, pad_token_id=0)
    free = model.generate(prompt, eos_token_id=None, do_sample=False, **kw)
    assert free.shape == (3, 61)
    hf_free = model.generate(prompt, eos_token_id=None, do_sample=False, disable_compile=True, **kw)
    eager_free = None
    with torch.no_grad():
        for eos in (None, int(hf_free[0, 21 + 9])):
            exact = greedy_generate(model.decoder(), prompt, inductor=False, eos_token_id=eos, **kw)
            hf = model.generate(prompt, eos_token_id=eos, do_sample=False, disable_compile=True, **kw)
            _same_up_to_a_near_tie(model, exact, hf, mask, 21)
            if eos is None:
                eager_free = exact
        # the call kept its session: the prompt's bucket (21 -> 32 rows) and the step were captured, and a second
        # call replays both with the same cache
        session = model.decoder().sparta_decode_sessions[3]
        assert session.prefills[32].graph is not None and all(lp.graph is not None for lp in session.loops.values())
        cache = session.cache
        again = greedy_generate(model.decoder(), prompt, inductor=False, eos_token_id=None, **kw)
        assert torch.equal(again, eager_free) and session.cache is cache
        _same_up_to_a_near_tie(model, free, hf_free, mask, 21)


def _same_up_to_a_near_tie(model, got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, start: int) -> None:
    """``got`` and ``want``, generated from one left-padded prompt batch of ``start`` tokens, are the same tokens up to
    their first differing step, where each differing row's two tokens are within rounding of each other (a logit gap
    under 0.1 in ``want``'s context); after it they may part."""
    n = min(got.shape[1], want.shape[1])
    differ = (got[:, :n] != want[:, :n]).any(0).nonzero()
    if not len(differ):
        assert got.shape == want.shape, (got, want)
        return
    col = int(differ[0])
    assert col >= start, (col, got, want)
    ext = torch.cat([mask, torch.ones(mask.shape[0], col - start, dtype=mask.dtype, device=mask.device)], 1)
    position = (ext.cumsum(-1) - 1).masked_fill(ext == 0, 1)          # as generate() places a padded row
    logits = model.decoder()(want[:, :col], attention_mask=ext, position_ids=position,
                             use_cache=False).logits[:, -1].float()
    for row in (got[:, col] != want[:, col]).nonzero().flatten().tolist():
        gap = (logits[row, want[row, col]] - logits[row, got[row, col]]).abs().item()
        assert gap < 0.1, (row, col, gap)
