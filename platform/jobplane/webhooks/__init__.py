"""Signed webhooks: subscriptions, their deliveries and the notifier that sends them."""
