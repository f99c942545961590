"""One request that the gateway refuses while saturated, sent with the real OpenAI Python
client and its own retries, to show the client honours the 429's Retry-After.

Usage: openai_retry.py GATEWAY_URL RETRIES. The request carries the priority header of a
band the test configures as sheddable, so every attempt is refused while the fleet is
saturated. Prints one JSON line: the attempts the client made (seconds since the first),
the final status, and the error body's type.
"""

import json
import sys
import time

from openai import DefaultHttpxClient, OpenAI, RateLimitError

url, retries = sys.argv[1], int(sys.argv[2])
t0 = time.monotonic()
attempts = []


def on_request(_request):
    attempts.append(round(time.monotonic() - t0, 3))


client = OpenAI(
    base_url=url.rstrip("/") + "/v1",
    api_key="unused",
    max_retries=retries,
    timeout=30,
    # The SDK's own HTTP client (httpx or its successor, whichever this release uses),
    # with a hook that timestamps every attempt.
    http_client=DefaultHttpxClient(event_hooks={"request": [on_request]}),
    default_headers={"x-kvroute-priority": "-5"},
)
status, kind, retry_after = 200, "", ""
try:
    client.completions.create(model="m", prompt="a batch job's prompt " * 40, max_tokens=4)
except RateLimitError as e:
    status = e.status_code
    kind = (e.body or {}).get("type", "") if isinstance(e.body, dict) else ""
    retry_after = e.response.headers.get("retry-after", "")
print(json.dumps({"attempts": attempts, "status": status, "type": kind, "retry_after": retry_after}))
