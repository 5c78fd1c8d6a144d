"""A plain ReAct agent: the kind of harness the agentrl proxy trains without changing it.

It knows nothing of agentrl. It talks to a model through the official ``openai``
client and plays a text env over HTTP with ``httpx``. Everything comes from
environment variables:

    OPENAI_BASE_URL, OPENAI_API_KEY   the model endpoint (the proxy session)
    AGENTRL_ENV_URL, AGENTRL_ENV_TOKEN the env server (``agentrl env serve``)
    AGENTRL_ENV_INSTANCE              an env made for this run; or else
    AGENTRL_ENV_ID (+ AGENTRL_ENV_SEED) to make one here
    REACT_MODEL, REACT_MAX_TURNS, REACT_MAX_TOKENS, REACT_TEMPERATURE

Each turn the model writes ``Thought: ...`` then ``Action: ...``; the action
line goes to the env and its answer comes back as ``Observation: ...``. It stops
when the env says the episode is over, or after REACT_MAX_TURNS turns.

    python examples/harness/react_agent.py
"""

from __future__ import annotations

import os
import re
import sys

import httpx
from openai import OpenAI

SYSTEM = (
    "You are an agent acting in a text environment. Each turn, think briefly, then act.\n"
    "Answer in exactly this format:\n"
    "Thought: <your reasoning>\n"
    "Action: <the action to take>"
)
_ACTION = re.compile(r"Action:\s*(.+)", re.IGNORECASE)


def parse_action(text: str) -> str:
    """The text after the last ``Action:``; the whole reply if there is none."""
    found = _ACTION.findall(text)
    return found[-1].strip() if found else text.strip()


def main() -> int:
    env_url = os.environ["AGENTRL_ENV_URL"].rstrip("/")
    env_http = httpx.Client(base_url=env_url, timeout=120.0,
                            headers={"Authorization": f"Bearer {os.environ['AGENTRL_ENV_TOKEN']}"})
    instance = os.environ.get("AGENTRL_ENV_INSTANCE")
    if instance:
        state = env_http.get(f"/envs/{instance}").raise_for_status().json()
    else:
        seed = os.environ.get("AGENTRL_ENV_SEED")
        state = env_http.post("/envs", json={"env_id": os.environ["AGENTRL_ENV_ID"],
                                             "seed": int(seed) if seed else None}).raise_for_status().json()
        instance = state["id"]

    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    model = os.environ.get("REACT_MODEL", "policy")
    max_turns = int(os.environ.get("REACT_MAX_TURNS", "8"))
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Observation: {state['observation']}"}]
    total = 0.0
    for turn in range(max_turns):
        reply = client.chat.completions.create(
            model=model, messages=messages,
            max_tokens=int(os.environ.get("REACT_MAX_TOKENS", "128")),
            temperature=float(os.environ.get("REACT_TEMPERATURE", "1.0")),
        )
        text = reply.choices[0].message.content or ""
        action = parse_action(text)
        step = env_http.post(f"/envs/{instance}/step", json={"action": action}).raise_for_status().json()
        total += step["reward"]
        print(f"turn {turn}: action={action!r} reward={step['reward']}", flush=True)
        if step["terminated"] or step["truncated"]:
            break
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": f"Observation: {step['observation']}"})
    print(f"total reward {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
