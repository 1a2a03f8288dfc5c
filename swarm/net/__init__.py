"""The swarm's networking: Ed25519 identities, signed envelopes, the framed TCP transport,
membership and failure detection, the inbox, and payload framing. No algorithm here."""
