"""The collector: an OpenAI-compatible proxy in front of the engine that captures turns.

Agents point their OpenAI client here. Each request is rendered with the model's chat
template and sent to the engine as token ids; the answer goes back in OpenAI's shape,
and every main-line turn is emitted to the `turns` stream once its next state is known
(docs/design.md#pairing-a-turn-with-its-next-state). Using it: docs/agents.md.
"""
