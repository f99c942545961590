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
    keep = {k: v for k, v in r.items() if isinstance(v, (int, float, str))}
    print(json.dumps({"router_mode": mode, "workers": workers, "blocks": blocks, **keep}))


if __name__ == "__main__":
    main()
