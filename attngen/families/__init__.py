"""The built-in kernel families, one subpackage each; ``attngen.family`` imports every one of them
on first use of the registry, and each registers itself (``attngen.family.register``)."""
