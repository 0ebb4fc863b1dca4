"""Cross-role pieces of kvyard: roles and their launcher, model-file discovery, logging, block keys."""
