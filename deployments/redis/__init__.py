"""Redis ACL and TLS set-up for Nitro."""
