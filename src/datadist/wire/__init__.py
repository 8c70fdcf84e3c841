"""The peer protocol, sans-IO."""
