"""How a call is laid out: buffer bytes (workspace), rounds, where ranks work (devices), header constants."""
