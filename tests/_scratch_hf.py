import functools, sys, tempfile, os

sys.path.insert(0, "tests")
import torch
from harness import run_ranks
import hf_models as H


def train_save(kind, path):
    import torch.distributed as dist
    import shardkit.checkpoint as dcp
    from shardkit.checkpoint.state_dict import get_state_dict
    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    rank, world = dist.get_rank(), dist.get_world_size()
    m = H.build(kind)
    pol = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={H.LAYER_CLS[kind]})
    m = FSDP(m, auto_wrap_policy=pol)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for ids in H.batches(2, 4):
        H.loss_of(m, ids.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    ids = H.batches(1, 2, seed=5)[0]
    m.eval()
    with torch.no_grad():
        return m(input_ids=ids).logits.numpy()


def export(kind, path, out):
    from shardkit.checkpoint.hf import to_hf

    rep = to_hf(
        path, out, config=H.config(kind) if False else H.build(kind).config, max_shard_size=20000
    )
    return rep


if __name__ == "__main__":
    kind = sys.argv[1]
    d = tempfile.mkdtemp()
    ck, out = d + "/ck", d + "/hf"
    logits = run_ranks(train_save, 2, kind, ck)[0]
    rep = run_ranks(export, 2, kind, ck, out)[0]
    print(rep.files, rep.prefix, rep.tied, rep.missing_buffers, rep.dropped[:5], len(rep.dropped))
    print(os.listdir(out))
    import transformers

    m = (
        transformers.AutoModelForCausalLM.from_pretrained(out)
        if kind != "bert"
        else transformers.AutoModelForMaskedLM.from_pretrained(out)
    )
    m.eval()
    ids = H.batches(1, 2, seed=5)[0]
    with torch.no_grad():
        got = m(input_ids=ids).logits
    print("maxdiff", (got - torch.from_numpy(logits)).abs().max().item())
