"""Sans-IO Edge-Node protocol: messages, framing, connection state. No trio here."""
