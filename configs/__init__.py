"""The shipped run recipes (YAML). A wheel installs this folder as ``diffalign._configs``, so that
``diffalign recipes`` and ``diffalign train shapes/flow_grpo`` find them outside a checkout."""
