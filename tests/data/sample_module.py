"""A small inventory module used as test fixture text (written for specd's tests)."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Iterable, Iterator


class InventoryError(Exception):
    """Raised when an operation would leave the inventory inconsistent."""


@dataclasses.dataclass
class Item:
    sku: str
    name: str
    price_cents: int
    quantity: int = 0
    tags: tuple[str, ...] = ()

    def total_cents(self) -> int:
        return self.price_cents * self.quantity

    def with_quantity(self, quantity: int) -> "Item":
        if quantity < 0:
            raise InventoryError(f"negative quantity for {self.sku}: {quantity}")
        return dataclasses.replace(self, quantity=quantity)

    def to_dict(self) -> dict:
        return {
            "sku": self.sku,
            "name": self.name,
            "price_cents": self.price_cents,
            "quantity": self.quantity,
            "tags": list(self.tags),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Item":
        return cls(
            sku=str(data["sku"]),
            name=str(data["name"]),
            price_cents=int(data["price_cents"]),
            quantity=int(data.get("quantity", 0)),
            tags=tuple(data.get("tags", ())),
        )


class Inventory:
    def __init__(self, items: Iterable[Item] = ()):
        self._items: dict[str, Item] = {}
        self._by_tag: dict[str, set[str]] = defaultdict(set)
        for item in items:
            self.add(item)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(sorted(self._items.values(), key=lambda item: item.sku))

    def __contains__(self, sku: str) -> bool:
        return sku in self._items

    def add(self, item: Item) -> None:
        if item.sku in self._items:
            raise InventoryError(f"duplicate sku {item.sku}")
        self._items[item.sku] = item
        for tag in item.tags:
            self._by_tag[tag].add(item.sku)

    def remove(self, sku: str) -> Item:
        item = self._items.pop(sku, None)
        if item is None:
            raise InventoryError(f"unknown sku {sku}")
        for tag in item.tags:
            self._by_tag[tag].discard(sku)
        return item

    def get(self, sku: str) -> Item:
        try:
            return self._items[sku]
        except KeyError:
            raise InventoryError(f"unknown sku {sku}") from None

    def restock(self, sku: str, amount: int) -> Item:
        if amount <= 0:
            raise InventoryError(f"restock amount must be positive, got {amount}")
        item = self.get(sku)
        updated = item.with_quantity(item.quantity + amount)
        self._items[sku] = updated
        return updated

    def sell(self, sku: str, amount: int) -> Item:
        if amount <= 0:
            raise InventoryError(f"sell amount must be positive, got {amount}")
        item = self.get(sku)
        if item.quantity < amount:
            raise InventoryError(f"only {item.quantity} of {sku} left, cannot sell {amount}")
        updated = item.with_quantity(item.quantity - amount)
        self._items[sku] = updated
        return updated

    def tagged(self, tag: str) -> list[Item]:
        return [self._items[sku] for sku in sorted(self._by_tag.get(tag, ()))]

    def total_value_cents(self) -> int:
        return sum(item.total_cents() for item in self._items.values())

    def low_stock(self, threshold: int = 5) -> list[Item]:
        return [item for item in self if item.quantity < threshold]

    def most_valuable(self, count: int = 3) -> list[Item]:
        ranked = sorted(self._items.values(), key=lambda item: item.total_cents(), reverse=True)
        return ranked[:count]

    def to_json(self) -> str:
        return json.dumps([item.to_dict() for item in self], indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Inventory":
        return cls(Item.from_dict(entry) for entry in json.loads(text))


def format_price(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}${cents // 100}.{cents % 100:02d}"


def report(inventory: Inventory) -> str:
    lines = ["SKU        NAME                 QTY      VALUE"]
    for item in inventory:
        lines.append(
            f"{item.sku:<10} {item.name:<20} {item.quantity:>4} {format_price(item.total_cents()):>10}"
        )
    lines.append(f"{'total':<36} {format_price(inventory.total_value_cents()):>10}")
    return "\n".join(lines)


def merge(first: Inventory, second: Inventory) -> Inventory:
    merged = Inventory()
    for item in first:
        merged.add(item)
    for item in second:
        if item.sku in merged:
            existing = merged.get(item.sku)
            if existing.price_cents != item.price_cents:
                raise InventoryError(f"price conflict for {item.sku}")
            merged.restock(item.sku, item.quantity) if item.quantity else None
        else:
            merged.add(item)
    return merged


def price_histogram(inventory: Inventory, bucket_cents: int = 500) -> dict[int, int]:
    histogram: dict[int, int] = defaultdict(int)
    for item in inventory:
        histogram[item.price_cents // bucket_cents * bucket_cents] += 1
    return dict(sorted(histogram.items()))


def apply_discount(inventory: Inventory, tag: str, percent: int) -> list[Item]:
    if not 0 < percent < 100:
        raise InventoryError(f"discount must be between 1 and 99 percent, got {percent}")
    changed = []
    for item in inventory.tagged(tag):
        discounted = dataclasses.replace(item, price_cents=item.price_cents * (100 - percent) // 100)
        inventory.remove(item.sku)
        inventory.add(discounted)
        changed.append(discounted)
    return changed


def parse_csv_line(line: str) -> Item:
    fields = [field.strip() for field in line.split(",")]
    if len(fields) < 3:
        raise InventoryError(f"expected at least 3 fields, got {len(fields)}: {line!r}")
    sku, name, price = fields[:3]
    quantity = int(fields[3]) if len(fields) > 3 and fields[3] else 0
    tags = tuple(tag for tag in fields[4:] if tag)
    return Item(sku=sku, name=name, price_cents=int(round(float(price) * 100)), quantity=quantity, tags=tags)


def load_csv(lines: Iterable[str]) -> Inventory:
    inventory = Inventory()
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            inventory.add(parse_csv_line(line))
        except (InventoryError, ValueError) as err:
            raise InventoryError(f"line {number}: {err}") from None
    return inventory


def dump_csv(inventory: Inventory) -> list[str]:
    rows = []
    for item in inventory:
        price = format_price(item.price_cents).lstrip("$")
        rows.append(",".join([item.sku, item.name, price, str(item.quantity), *item.tags]))
    return rows


if __name__ == "__main__":
    demo = Inventory(
        [
            Item("A-100", "widget", 250, 40, ("hardware",)),
            Item("A-200", "gadget", 1299, 3, ("hardware", "gift")),
            Item("B-100", "manual", 1500, 12, ("books",)),
        ]
    )
    print(report(demo))
