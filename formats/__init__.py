"""The contract between training and runtime: op registry, model description, `.bin` format."""
