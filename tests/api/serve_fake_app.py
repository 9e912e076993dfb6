"""The front end on Ray Serve over the fake engine, in a cluster of its own (run by test_serve_ingress.py):

    python -m tests.api.serve_fake_app PORT TOKENIZER_FOLDER

The engine is a Serve deployment of its own and the ingress calls it through its handle, as the
real engine will be called. Prints READY once the endpoint answers; then each line on stdin is a
command (`record`: the engine's record as one JSON line); end of stdin shuts the cluster down.
"""

from __future__ import annotations

import json
import sys

import ray
from ray import serve

from distpool.api.engine import ModelCard
from distpool.api.ingress import ApiIngress
from distpool.api.settings import ApiSettings
from tests.api.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_ids
from tests.api.fake_engine import FakeEngine

API_KEY = "test-key"
REPLY = "Ça marche 🙂 STOP jamais montré"


def reply(prompt_ids, args) -> list[int]:
    return (byte_ids(REPLY) * 4)[: args.max_tokens]


class RecordingEngine(FakeEngine):
    async def record(self) -> dict:
        return {
            "started": self.started,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "aborted": self.aborted,
        }


def main(port: int, folder: str) -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        card = ModelCard(
            served_name="tiny-bytes", context_len=128, vocab_size=VOCAB_SIZE, eos_token_ids=(EOS_ID,),
            tokenizer_folder=folder,
        )  # fmt: skip
        engine = serve.deployment(RecordingEngine, name="engine", ray_actor_options={"num_cpus": 0})
        ingress = ApiIngress.options(ray_actor_options={"num_cpus": 0})
        app = ingress.bind(engine.bind(card, reply, step_delay_s=0.02), ApiSettings(api_key=API_KEY))
        serve.run(app, name="distpool", route_prefix="/")
        handle = serve.get_deployment_handle("engine", app_name="distpool")
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip() == "record":
                print(json.dumps(handle.record.remote().result()), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
