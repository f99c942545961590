"""NVIDIA Dynamo's KV router, offline: `dynamo.replay` (PyPI `ai-dynamo`, its mocker
engines) over a Mooncake-format trace, printing one JSON line with the prefix reuse it
reaches. `make peers-dynamo` installs it into target/peers/dynamo-venv and runs this
beside `kvroute-bench sim`'s imitation of the same policy at the same capacities.

usage: dynamo_replay.py TRACE WORKERS BLOCKS_PER_WORKER [kv_router|round_robin]
"""
import json
import sys

from dynamo.replay.api import run_trace_replay


def main():
    trace, workers, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "kv_router"
    report = run_trace_replay(
        [trace],
        extra_engine_args={"engine": {"block_size": 512, "num_gpu_blocks": blocks}},
        num_workers=workers,
        router_mode=mode,
        trace_format="mooncake",
        trace_block_size=512,
    )
    r = report if isinstance(report, dict) else report.to_dict()
    s = r.get("summary", {})
    keep = ["prefix_cache_reused_ratio", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_e2e_latency_ms", "p99_e2e_latency_ms"]
    print(json.dumps({"router_mode": mode, "workers": workers, "blocks": blocks,
                      **{k: s.get(k) for k in keep}}))


if __name__ == "__main__":
    main()
