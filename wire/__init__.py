"""Sans-IO Edge-Node protocol: messages, framing, connection state. No trio here.

The public pieces: ``wire.messages`` (the tagged message union), ``wire.scram``
(the handshake's SCRAM-SHA-256 math and the node verifier),
``wire.framing`` (``encode_frame``, ``FrameDecoder``, ``MAX_FRAME_BYTES``),
``wire.connection`` (``Connection``, ``Role``: the handshake and stream state
table) and ``wire.errors`` (``WireError`` and its subclasses).
"""
