"""Workloads that repeat across requests, as a server sees them: `headstart bench --workload NAME` replays one in
order, each method with its own drafter (a suffix pool starting empty fills as in service).

Generated here, seeded (the text is the project's: synthetic documents and tool results, not training prompts,
not Spec-Bench; no prompt repeats another verbatim):

- `extraction`: the same instruction and JSON schema over many synthetic order messages (a structured-extraction
  job: the answers share their keys and form, the documents differ);
- `agent`: tool-calling transcripts, each task re-sent with one more step a turn (an agent loop: what the
  transcript re-sends, prompt lookup already copies; what the model writes at each step repeats across tasks);
- `helpdesk`: one long policy before every customer message, the messages from a few templates (held out: the
  suffix pool's settings were chosen on the two above).

The first WARM share of a workload is its own category (`NAME (first 20%)`): the pool is filling there; the rest
(`NAME (last 80%)`) is what a warm server sees.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from headstart.runtime.prompts import Prompt

WARM = 0.2  # the share of a workload's prompts reported apart: the pool fills during it

FIRST = ["Ana", "Bilal", "Chen", "Dara", "Elif", "Femi", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena", "Mateo"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Haddad", "Kowalski", "Brennan", "Rossi"]
CITIES = ["Lisbon", "Osaka", "Tunis", "Quito", "Tallinn", "Perth", "Accra", "Bergen", "Cusco", "Hanoi", "Leeds"]
ITEMS = ["desk lamp", "water bottle", "notebook", "phone case", "backpack", "kettle", "yoga mat", "headphones"]
CARRIERS = ["ParcelGo", "SwiftShip", "Northline", "BluePost"]
SCHEMA = (
    '{"order_id": string, "customer": string, "city": string, "items": [{"name": string, "quantity": integer, '
    '"unit_price": number}], "total": number, "carrier": string}'
)


def extraction(n: int, rng: random.Random) -> list[str]:
    """The same instruction and schema over `n` order messages written in varied ways."""
    openings = [
        "Hi, this is {customer} from {city}. I just placed order {order} and wanted to confirm it.",
        "Order {order} came in from {customer} ({city}) this morning.",
        "Confirmation for {customer}, {city}: your order {order} has been received.",
        "New order {order}. Customer: {customer}. Delivery city: {city}.",
    ]
    lines = [
        "It has {quantity} x {name} at ${price} each.",
        "{quantity} {name}(s), ${price} per unit.",
        "Also included: {name}, quantity {quantity}, priced ${price}.",
    ]
    closings = ["It ships with {carrier}.", "Carrier: {carrier}.", "We will send it via {carrier} tomorrow."]
    prompts = []
    for _ in range(n):
        order = f"{rng.choice('ABCDEFGH')}{rng.randint(1000, 9999)}"
        customer, city = f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.choice(CITIES)
        items = [(rng.choice(ITEMS), rng.randint(1, 6), rng.randint(3, 120) + rng.choice([0, 0.5, 0.99]))]
        items += [(rng.choice(ITEMS), rng.randint(1, 6), rng.randint(3, 120)) for _ in range(rng.randint(0, 2))]
        text = rng.choice(openings).format(customer=customer, city=city, order=order)
        for name, quantity, price in items:
            text += " " + rng.choice(lines).format(quantity=quantity, name=name, price=price)
        text += " " + rng.choice(closings).format(carrier=rng.choice(CARRIERS))
        prompts.append(
            "Extract the order details from the message below. Answer with JSON only, exactly in this form:\n"
            f"{SCHEMA}\n\nMessage:\n{text}"
        )
    return prompts


TOOLS = """You are a travel assistant. You can call these tools, one per line, as CALL name {json arguments}:
- search_flights {"origin": string, "destination": string, "date": "YYYY-MM-DD"}
- get_weather {"city": string, "date": "YYYY-MM-DD"}
- find_hotels {"city": string, "nights": integer, "max_price": number}
- book {"flight_id": string, "hotel_id": string}
Each call is answered by a RESULT line. Write the next CALL line only, or FINAL: and a one-sentence summary."""


def agent(n: int, rng: random.Random) -> list[str]:
    """Tool-calling tasks, each re-sent with one more step of its transcript a turn, until `n` prompts."""
    prompts: list[str] = []
    while len(prompts) < n:
        origin, destination = rng.sample(CITIES, 2)
        date = f"2027-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        nights, budget = rng.randint(2, 7), rng.choice([80, 120, 150, 200])
        task = f"Plan a trip from {origin} to {destination} on {date} for {nights} nights, hotels under ${budget}."
        flight, hotel = f"F{rng.randint(100, 999)}", f"H{rng.randint(100, 999)}"
        steps = [
            f'CALL search_flights {{"origin": "{origin}", "destination": "{destination}", "date": "{date}"}}',
            f'RESULT {{"flights": [{{"id": "{flight}", "depart": "{rng.randint(6, 21):02d}:{rng.choice(["00", "30"])}",'
            f' "price": {rng.randint(90, 600)}}}]}}',
            f'CALL get_weather {{"city": "{destination}", "date": "{date}"}}',
            f'RESULT {{"forecast": "{rng.choice(["sunny", "rain", "cloudy", "windy"])}", '
            f'"high_c": {rng.randint(5, 34)}}}',
            f'CALL find_hotels {{"city": "{destination}", "nights": {nights}, "max_price": {budget}}}',
            f'RESULT {{"hotels": [{{"id": "{hotel}", "price": {budget - rng.randint(5, 40)}, "rating": '
            f"{rng.randint(30, 49) / 10}}}]}}",
            f'CALL book {{"flight_id": "{flight}", "hotel_id": "{hotel}"}}',
            f'RESULT {{"status": "confirmed", "reference": "{rng.randint(100000, 999999)}"}}',
        ]
        for k in range(0, len(steps) + 1, 2):  # the task alone, then after each tool's RESULT
            transcript = "\n".join(steps[:k])
            prompts.append(f"{TOOLS}\n\nTask: {task}\n\nTranscript:\n{transcript}".rstrip())
    return prompts[:n]


POLICY = """You answer customer messages for Brightway Outfitters, an online shop. Follow the policy below, be brief and
polite, and end every answer with "Is there anything else I can help you with?".
Policy:
- Returns: unused items can be returned within 30 days of delivery for a full refund; send them with the return
  label from the account page. Refunds reach the original payment method within 5 business days of arrival.
- Damaged or wrong items: we send a replacement at no cost; the customer does not need to return the item.
- Late orders: standard shipping takes 3-5 business days; after 7 business days we resend the order or refund it.
- Address changes: possible until the order ships; after that the carrier's tracking page offers a redirect.
- Warranty: every item has a one-year warranty against defects; repairs or replacements are free within it.
- Never promise discounts, and never ask for card numbers or passwords."""


def helpdesk(n: int, rng: random.Random) -> list[str]:
    """A help desk: one long policy before every message, customer messages written from a few templates (held out
    from the suffix pool's tuning, which used `extraction` and `agent`: repeats of another kind)."""
    problems = [
        "the {item} arrived damaged",
        "I received a {item} instead of what I ordered",
        "it still has not arrived after {days} business days",
        "I would like to return the {item}, it is unused",
        "I need to change the delivery address to {city}",
        "the {item} stopped working after {months} months",
    ]
    openings = ["Hi,", "Hello,", "Good morning,", "Hey there,", "Dear support,"]
    asks = ["What can you do?", "What are my options?", "Can you help?", "How do I proceed?", "Please advise."]
    prompts = []
    for _ in range(n):
        order = f"{rng.choice('ABCDEFGH')}{rng.randint(1000, 9999)}"
        problem = rng.choice(problems).format(
            item=rng.choice(ITEMS), days=rng.randint(2, 12), city=rng.choice(CITIES), months=rng.randint(2, 20)
        )
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        message = f"{rng.choice(openings)} my order {order} - {problem}. {rng.choice(asks)} {name}"
        prompts.append(f"{POLICY}\n\nCustomer message:\n{message}")
    return prompts


WORKLOADS: dict[str, Callable[[int, random.Random], list[str]]] = {
    "extraction": extraction,
    "agent": agent,
    "helpdesk": helpdesk,
}


def workload(name: str, n: int = 40, seed: int = 0) -> list[Prompt]:
    """The workload's `n` prompts in the order a server would see them, its first WARM share categorised apart."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    texts = WORKLOADS[name](n, random.Random(seed))
    warm = max(1, round(WARM * n))
    return [
        Prompt(f"{name}-{i:03d}", f"{name} ({'first 20%' if i < warm else 'last 80%'})", text)
        for i, text in enumerate(texts)
    ]


def write(prompts: list[Prompt], path: Path) -> Path:
    """The prompts as a JSONL prompt file (`runtime/prompts.py`'s rows), in order."""
    rows = [{"id": p.id, "category": p.category, "turns": [p.text]} for p in prompts]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
