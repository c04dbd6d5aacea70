"""eagle2_cli: the `eagle2` command line (Click + Rich + prompt-toolkit). No decoding logic here."""
