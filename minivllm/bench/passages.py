"""Real text for the `repeat` workload (`python -m minivllm.bench spec --workload repeat`): prompts whose answer
copies text the prompt already holds, where n-gram prompt lookup (minivllm/spec_decode/ngram_proposer.py) finds
its drafts.

Owns: the passages (public-domain English prose: Lincoln, Austen, Darwin, the US Constitution, Dickens, the
Declaration of Independence) and a Python class, and nothing else. Each is 130-230 tokens for SmolLM2's
tokenizer, so a copy is an output of that length. Which of them the workload asks for, and how, is in
workload.py (`REPEAT_TASKS`): only the tasks SmolLM2-135M-Instruct answers greedily with a near copy.
"""

PASSAGES = {
    "gettysburg": (
        "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
        "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil "
        "war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on "
        "a great battle-field of that war. We have come to dedicate a portion of that field, as a final resting place "
        "for those who here gave their lives that that nation might live. It is altogether fitting and proper that we "
        "should do this. But, in a larger sense, we can not dedicate, we can not consecrate, we can not hallow this "
        "ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to "
        "add or detract. The world will little note, nor long remember what we say here, but it can never forget what "
        "they did here."),
    "austen": (
        "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of "
        "a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, "
        "this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful "
        "property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, "
        "\"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it is,\" "
        "returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no answer. "
        "\"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, and I have no "
        "objection to hearing it.\" This was invitation enough."),
    "darwin": (
        "It is interesting to contemplate an entangled bank, clothed with many plants of many kinds, with birds singing "
        "on the bushes, with various insects flitting about, and with worms crawling through the damp earth, and to "
        "reflect that these elaborately constructed forms, so different from each other, and dependent on each other in "
        "so complex a manner, have all been produced by laws acting around us. These laws, taken in the highest sense, "
        "being Growth with Reproduction; Inheritance which is almost implied by reproduction; Variability from the "
        "indirect and direct action of the external conditions of life, and from use and disuse; a Ratio of Increase so "
        "high as to lead to a Struggle for Life, and as a consequence to Natural Selection, entailing Divergence of "
        "Character and the Extinction of less-improved forms."),
    "constitution": (
        "We the People of the United States, in Order to form a more perfect Union, establish Justice, insure domestic "
        "Tranquility, provide for the common defence, promote the general Welfare, and secure the Blessings of Liberty "
        "to ourselves and our Posterity, do ordain and establish this Constitution for the United States of America. "
        "All legislative Powers herein granted shall be vested in a Congress of the United States, which shall consist "
        "of a Senate and House of Representatives. The House of Representatives shall be composed of Members chosen "
        "every second Year by the People of the several States. No Person shall be a Representative who shall not have "
        "attained to the Age of twenty five Years, and been seven Years a Citizen of the United States."),
    "dickens": (
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
        "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
        "Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing "
        "before us, we were all going direct to Heaven, we were all going direct the other way. There were a king with "
        "a large jaw and a queen with a plain face, on the throne of England; there were a king with a large jaw and a "
        "queen with a fair face, on the throne of France."),
    "declaration": (
        "When in the Course of human events, it becomes necessary for one people to dissolve the political bands which "
        "have connected them with another, and to assume among the powers of the earth, the separate and equal station "
        "to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind "
        "requires that they should declare the causes which impel them to the separation. We hold these truths to be "
        "self-evident, that all men are created equal, that they are endowed by their Creator with certain unalienable "
        "Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these rights, "
        "Governments are instituted among Men, deriving their just powers from the consent of the governed."),
}

# Python code: the rename task renames a variable in it (as an editor's "rename symbol" would)
CODE = {
    "inventory": (
        "class Inventory:\n"
        "    def __init__(self):\n"
        "        self.items = []\n"
        "\n"
        "    def add(self, name, quantity, price):\n"
        "        self.items.append({'name': name, 'quantity': quantity, 'price': price})\n"
        "\n"
        "    def total_value(self):\n"
        "        return sum(item['quantity'] * item['price'] for item in self.items)\n"
        "\n"
        "    def find(self, name):\n"
        "        for item in self.items:\n"
        "            if item['name'] == name:\n"
        "                return item\n"
        "        return None\n"),
}
