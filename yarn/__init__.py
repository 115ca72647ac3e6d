"""YaRN rotary-embedding scaling shared by the trainer and the engines."""
