import sys, torch, sparta
m = sparta.load(sys.argv[1], inductor=False).to("cuda")
vocab = m.graph.tensor("embed_tokens.weight").shape[0]
for t in (512, 1, 4, 100, 1100):
    ids = torch.randint(0, vocab, (1, t), device="cuda")
    try:
        out = m(ids); torch.cuda.synchronize()
        print(t, "ok", out[0].shape if isinstance(out, (tuple, list)) else type(out))
    except Exception as e:
        print(t, "FAILED", str(e)[:3000]); break
