"""What every wire shares: strict integers off the wire, request bodies and media types."""
