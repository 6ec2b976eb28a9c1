"""Which FlexAttention path computes the tree mask right on the GPU (a tree_flex debugging aid)."""
import time, warnings, torch, tree_recurrence as tr
from tree_recurrence import attention as A
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
warnings.filterwarnings("ignore")
torch.manual_seed(0)
def case(segs, maxlen, H, D, dtype):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, maxlen, (segs,), generator=g)
    parents = [-1] + [int(torch.randint(-1, s, (1,), generator=g)) for s in range(1, segs)]
    off = torch.zeros(segs + 1, dtype=torch.int64); off[1:] = lengths.cumsum(0)
    kw = {"tree_cu_seqlens_q": off.cuda(), "tree_segment_parents": torch.tensor(parents).cuda()}
    plan = tr.tree_plan(kw); n = plan.num_tokens
    q = torch.randn(1, H, n, D, device="cuda", dtype=dtype); k = torch.randn(1, H // 4, n, D, device="cuda", dtype=dtype); v = torch.randn_like(k)
    dense = A._dense_flex_mask(plan, "cuda", None)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1), attn_mask=dense[None, None])
    mine = A.tree_block_mask(plan, "cuda", None); mm = A.tree_mask_mod(plan, "cuda", None)
    theirs = create_block_mask(mm, 1, 1, n, n, device="cuda", BLOCK_SIZE=128)
    print(f"n={n} H={H} D={D} {dtype} kv_num equal: {torch.equal(mine.kv_num_blocks, theirs.kv_num_blocks)} full equal: {torch.equal(mine.full_kv_num_blocks, theirs.full_kv_num_blocks)}")
    err = lambda o: ((o.float() - ref).norm() / ref.norm()).item()
    for name, fn in [("eager", flex_attention), ("compiled-dynamic", torch.compile(flex_attention, dynamic=True)), ("compiled-static", torch.compile(flex_attention))]:
        for bname, bm in [("mine", mine), ("torch", theirs)]:
            t = time.time()
            try:
                o = fn(q, k, v, block_mask=bm, enable_gqa=True)
                print(f"  {name:17s} {bname:6s} rel err {err(o):.2e}  ({time.time()-t:.1f}s)", flush=True)
            except Exception as e:
                print(f"  {name:17s} {bname:6s} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
case(30, 60, 16, 128, torch.float32)
case(12, 400, 16, 128, torch.bfloat16)
