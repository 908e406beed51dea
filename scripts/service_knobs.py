"""Lab 07's GPU service (ResNet-50 on JPEG photographs, BF16 channels-last in CUDA graphs, decode on the GPU) behind
nginx and two Tritons, for three settings of the preprocessing's instance count and queue delay and the classifier's
instances: where a request's time goes at 400-4,000 requests/s, the capacity of two, and one Triton without nginx.
How lab 07's knobs were chosen; needs a GPU and the service's servers (about 380 s on one H200).
    python scripts/service_knobs.py OUT_DIR   -> OUT_DIR/knobs.json, tables on stdout"""
import json
import os
import sys
import time

import pandas as pd

from lab_utils.serving import breakdown, capacity, load, service
from lab_utils.serving import client as triton_client
from lab_utils.serving import ensemble as ens

pd.set_option("display.width", 250)
pd.set_option("display.max_columns", 40)

if __name__ == "__main__":  # the client processes re-import this file
    OUT = sys.argv[1]
    base = {"preprocess_device": "gpu", "classifier_precision": "bf16", "channels_last": True, "cuda_graphs": True}
    variants = [("c2_d500", {"preprocess_count": 2, "preprocess_delay_us": 500}),
                ("c4_d1000", {"preprocess_count": 4, "preprocess_delay_us": 1000}),
                ("c4_d2000_i1", {"preprocess_count": 4, "preprocess_delay_us": 2000, "instances": 1})]
    photos = ens.photo_jpegs(256)
    out = {}
    t0 = time.time()
    with service.Service() as svc:
        print("service up", svc, round(time.time() - t0, 1), flush=True)
        rn = None
        for tag, knobs in variants:
            rn = ens.build_resnet50_service(svc.repo.path, prefix=f"rn_{tag}", gpus=1, source=svc.servers[0].source,
                                            image_size=224, width=64, exported=rn, **base, **knobs)
            for s in svc.servers:
                triton_client.load_model(s.grpc_url, rn.service)
            tgt = svc.target("http", photos)
            tgt.model = rn.service
            w = breakdown.where_time_goes(svc, tgt, [400, 2000, 3000, 4000], duration_s=4.0, warmup_s=1.0,
                                          processes=None, models=rn.models)
            print(f"=== {tag} {knobs} t={time.time() - t0:.0f}s", flush=True)
            cols = ["offered_rps", "model", "requests", "batch_avg", "queue_ms", "compute_input_ms",
                    "compute_infer_ms", "compute_output_ms", "request_ms"]
            print(w[cols].round(2).to_string(), flush=True)
            per = w.drop_duplicates("offered_rps").set_index("offered_rps")
            print(per[[c for c in w if c.startswith("cpu_")] + ["answered_rps", "client_p95_ms", "send_lag_p99_ms",
                                                               "errors"]].round(2).to_string(), flush=True)
            out[tag] = w.to_dict("records")
            if tag == variants[-1][0] or tag == "c4_d1000":
                cap = capacity.find_capacity(tgt, 100.0, lo_rps=1000, hi_rps=6000, duration_s=4.0, tolerance=0.08,
                                             processes=None)
                print(f"capacity {tag}:", cap, flush=True)
                print(cap.table().round(1).to_string(), flush=True)
                out[f"cap_{tag}"] = cap.table().to_dict("records")
            # straight to one Triton at 1,500 (no nginx): what the front door costs
            direct = svc.target("http", photos)
            direct.model = rn.service
            direct.url = svc.servers[0].http_url.removeprefix("http://")
            r = load.run_open_loop(direct, 1500, 4.0, warmup_s=1.0, processes=None)
            print(f"direct one Triton @1500: {r}", flush=True)
            for m in rn.models[::-1]:
                for s in svc.servers:
                    triton_client.unload_model(s.grpc_url, m)
    json.dump(out, open(os.path.join(OUT, "knobs.json"), "w"), default=str)
    print("done", round(time.time() - t0), flush=True)
