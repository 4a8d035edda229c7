"""Test doubles. Everything here is a fake, never the real package it imitates."""
