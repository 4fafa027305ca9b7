import json, sys
for f in sys.argv[1:]:
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "missing", e); continue
    nccl = d.get("nccl") or {}
    print(f.split("/")[-1], "limit", round(d.get("copy_limit_gbps") or 0), d.get("copy_limit_method"),
          "nccl", {k: round(v["us"]) if isinstance(v, dict) and "us" in v else v for k, v in nccl.items()} if isinstance(nccl, dict) else nccl)
    for k, v in d.get("compare_sm", {}).items():
        for p in v:
            print("  ", p["num_sms"], " ".join(f"{n.replace('_kernel','')}={p[n]['us']:.0f}us/{p[n]['nvlink_gbps']:.0f}GB/s"
                                       for n in ("dispatch_kernel", "dispatch_cached_kernel", "combine_kernel") if n in p))
