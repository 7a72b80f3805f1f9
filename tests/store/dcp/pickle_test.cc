#include "store/dcp/pickle.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace ckptfs::store {
namespace {

using namespace std::string_literals;

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const std::filesystem::path kFixtures =
    std::filesystem::path(CKPTFS_SOURCE_DIR) / "tests/fixtures/dcp";

// Wraps opcodes in PROTO 4 ... STOP.
std::string P(std::string body) { return "\x80\x04"s + body + "."; }

std::string Debug(std::string_view bytes) {
  Result<PickleTree> t = ParsePickle(bytes);
  if (!t.ok()) return "ERROR: " + t.status().message();
  return t->DebugString(t->root(), 10000);
}

// pickle.dumps({'a': [1, 2.5, None, True, False, b'xy', (1, 2, 3)], 'big': 2**40, 'neg': -5,
//               'u': 'h\u00e9', 'e': ()}, protocol=N) from CPython 3.11.
const std::string kMixedP2 =
    "\x80\x02\x7d\x71\x00\x28\x58\x01\x00\x00\x00\x61\x71\x01\x5d\x71\x02\x28\x4b\x01\x47\x40\x04"
    "\x00\x00\x00\x00\x00\x00\x4e\x88\x89\x63\x5f\x63\x6f\x64\x65\x63\x73\x0a\x65\x6e\x63\x6f\x64"
    "\x65\x0a\x71\x03\x58\x02\x00\x00\x00\x78\x79\x71\x04\x58\x06\x00\x00\x00\x6c\x61\x74\x69\x6e"
    "\x31\x71\x05\x86\x71\x06\x52\x71\x07\x4b\x01\x4b\x02\x4b\x03\x87\x71\x08\x65\x58\x03\x00\x00"
    "\x00\x62\x69\x67\x71\x09\x8a\x06\x00\x00\x00\x00\x00\x01\x58\x03\x00\x00\x00\x6e\x65\x67\x71"
    "\x0a\x4a\xfb\xff\xff\xff\x58\x01\x00\x00\x00\x75\x71\x0b\x58\x03\x00\x00\x00\x68\xc3\xa9\x71"
    "\x0c\x58\x01\x00\x00\x00\x65\x71\x0d\x29\x75\x2e"s;
const std::string kMixedP3 =
    "\x80\x03\x7d\x71\x00\x28\x58\x01\x00\x00\x00\x61\x71\x01\x5d\x71\x02\x28\x4b\x01\x47\x40\x04"
    "\x00\x00\x00\x00\x00\x00\x4e\x88\x89\x43\x02\x78\x79\x71\x03\x4b\x01\x4b\x02\x4b\x03\x87\x71"
    "\x04\x65\x58\x03\x00\x00\x00\x62\x69\x67\x71\x05\x8a\x06\x00\x00\x00\x00\x00\x01\x58\x03\x00"
    "\x00\x00\x6e\x65\x67\x71\x06\x4a\xfb\xff\xff\xff\x58\x01\x00\x00\x00\x75\x71\x07\x58\x03\x00"
    "\x00\x00\x68\xc3\xa9\x71\x08\x58\x01\x00\x00\x00\x65\x71\x09\x29\x75\x2e"s;
const std::string kMixedP4 =
    "\x80\x04\x95\x50\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x01\x61\x94\x5d\x94\x28\x4b\x01"
    "\x47\x40\x04\x00\x00\x00\x00\x00\x00\x4e\x88\x89\x43\x02\x78\x79\x94\x4b\x01\x4b\x02\x4b\x03"
    "\x87\x94\x65\x8c\x03\x62\x69\x67\x94\x8a\x06\x00\x00\x00\x00\x00\x01\x8c\x03\x6e\x65\x67\x94"
    "\x4a\xfb\xff\xff\xff\x8c\x01\x75\x94\x8c\x03\x68\xc3\xa9\x94\x8c\x01\x65\x94\x29\x75\x2e"s;

TEST(Pickle, ReadsCPythonOutputAtProtocols2To5) {
  EXPECT_EQ(Debug(kMixedP3),
            "{'a': [1, 2.500000, None, True, False, b<2 bytes>, (1, 2, 3)], 'big': 1099511627776, "
            "'neg': -5, 'u': 'h\xc3\xa9', 'e': ()}");
  EXPECT_EQ(Debug(kMixedP4), Debug(kMixedP3));
  std::string p5 = kMixedP4;
  p5[1] = 5;
  EXPECT_EQ(Debug(p5), Debug(kMixedP3));
  // Protocol 2 has no bytes opcode; Python writes _codecs.encode('xy', 'latin1').
  EXPECT_EQ(Debug(kMixedP2),
            "{'a': [1, 2.500000, None, True, False, _codecs.encode('xy', 'latin1'), (1, 2, 3)], "
            "'big': 1099511627776, 'neg': -5, 'u': 'h\xc3\xa9', 'e': ()}");
  Result<PickleTree> t = ParsePickle(kMixedP4);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->protocol(), 4);
  EXPECT_EQ(t->dict_size(t->root()), 5u);
  EXPECT_EQ(t->int_value(t->DictGet(t->root(), "neg")), -5);
  EXPECT_EQ(t->DictGet(t->root(), "missing"), kNoNode);
}

TEST(Pickle, MemoReferencesShareOneNode) {
  // l = [1]; pickle.dumps([l, l, (l,)], protocol=4)
  std::string bytes =
      "\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x5d\x94\x28\x5d\x94\x4b\x01\x61\x68\x01\x68"
      "\x01\x85\x94\x65\x2e"s;
  Result<PickleTree> t = ParsePickle(bytes);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto outer = t->items(t->root());
  ASSERT_EQ(outer.size(), 3u);
  EXPECT_EQ(outer[0], outer[1]);
  EXPECT_EQ(t->items(outer[2])[0], outer[0]);
  EXPECT_EQ(t->DebugString(t->root()), "[[1], [1], ([1],)]");
}

TEST(Pickle, IntegersUpTo64BitsAndNoWider) {
  EXPECT_EQ(Debug("\x80\x02\x8a\x05\x00\x00\x00\x80\x00\x2e"s), "2147483648");
  EXPECT_EQ(Debug("\x80\x02\x4a\xff\xff\xff\xff\x2e"s), "-1");
  EXPECT_EQ(Debug("\x80\x02\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x2e"s), "9223372036854775807");
  EXPECT_EQ(Debug("\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x2e"s), "-9223372036854775808");
  EXPECT_EQ(Debug("\x80\x02\x8a\x01\xff\x2e"s), "-1");
  EXPECT_EQ(Debug("\x80\x02\x8a\x00\x2e"s), "0");
  EXPECT_EQ(Debug("\x80\x02\x4b\xff\x2e"s), "255");
  EXPECT_EQ(Debug("\x80\x02\x4d\xff\xff\x2e"s), "65535");
  // Redundant sign bytes beyond the eighth are fine; significant ones are not.
  EXPECT_EQ(Debug("\x80\x02\x8a\x0a\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x2e"s), "1");
  EXPECT_EQ(Debug("\x80\x02\x8b\x02\x00\x00\x00\xfe\xff\x2e"s), "-2");
  EXPECT_NE(
      Debug("\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00\x2e"s).find("wider than 64 bits"),
      std::string::npos);
  EXPECT_NE(
      Debug("\x80\x02\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\xff\x2e"s).find("wider than 64 bits"),
      std::string::npos);
  EXPECT_NE(Debug("\x80\x02\x8b\xff\xff\xff\xff\x2e"s).find("negative LONG4"), std::string::npos);
}

TEST(Pickle, GlobalsCallsObjectsAndPersistentIds) {
  // OrderedDict([('k', 1)]) at protocol 2: REDUCE then SETITEM on the result.
  std::string od =
      "\x80\x02\x63\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x0a\x4f\x72\x64\x65\x72\x65\x64\x44"
      "\x69\x63\x74\x0a\x71\x00\x29\x52\x71\x01\x58\x01\x00\x00\x00\x6b\x71\x02\x4b\x01\x73\x2e"s;
  Result<PickleTree> t = ParsePickle(od);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  NodeId root = t->root();
  EXPECT_EQ(t->kind(root), PickleKind::kReduce);
  EXPECT_TRUE(t->IsGlobal(t->callable(root), "collections", "OrderedDict"));
  EXPECT_TRUE(t->object_items_are_dict(root));
  EXPECT_EQ(t->items(root).size(), 2u);

  // NEWOBJ + BUILD, STACK_GLOBAL, BINPERSID.
  std::string obj =
      P("\x8c\x01m\x8c\x01"
        "C\x93)\x81}\x8c\x01x\x8c\x01ysb"s);
  EXPECT_EQ(Debug(obj), "new m.C()<-{'x': 'y'}");
  EXPECT_EQ(Debug(P("\x8c\x07storage\x85Q"s)), "persid('storage',)");
  EXPECT_EQ(Debug(P("N0\x88\x32\x86"s)), "(True, True)");  // POP and DUP
  // bytearray8 (protocol 5).
  EXPECT_EQ(Debug("\x80\x05\x95\x0d\x00\x00\x00\x00\x00\x00\x00\x96\x02\x00\x00\x00\x00\x00\x00\x00"
                  "\x61\x62\x94\x2e"s),
            "b<2 bytes>");
  // Keys may be objects.
  EXPECT_EQ(Debug(P("}\x8c\x01m\x8c\x01K\x93)\x81K\x01s"s)), "{new m.K(): 1}");
}

TEST(Pickle, UnknownOpcodeNamesByteAndOffset) {
  Result<PickleTree> t = ParsePickle(P("K\x01I1\n"s));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kUnsupported);
  EXPECT_NE(t.status().message().find("0x49"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("offset 4"), std::string::npos) << t.status().message();
  // Protocol 0 and out-of-band buffers are not supported either.
  EXPECT_FALSE(ParsePickle("(lp0\n."s).ok());
  EXPECT_FALSE(ParsePickle("\x80\x05\x97."s).ok());
  EXPECT_FALSE(ParsePickle("\x80\x06N."s).ok());
  EXPECT_FALSE(ParsePickle(""s).ok());
}

TEST(Pickle, RejectsMalformedStacksAndMarks) {
  const char* kBad[] = {
      "a",            // APPEND on an empty stack
      "t",            // TUPLE without MARK
      "(",            // MARK left open at STOP
      "]K\x01(a",     // APPEND whose list is hidden behind a MARK
      "}(K\x01u",     // SETITEMS with an odd number of items
      "K\x01K\x02s",  // SETITEM on an int
      "K\x01]a",      // APPEND onto... the list is the value, the int the target
      ")K\x01R",      // REDUCE with non-tuple args
      ")\x81",        // NEWOBJ with one value on the stack
      "K\x01K\x01"
      "b",                                    // BUILD on an int
      "h\x05",                                // BINGET of a key never stored
      "\x94",                                 // MEMOIZE on an empty stack
      "K\x01K\x02",                           // two values left at STOP
      "\x8c\x01m\x4b\x01\x93",                // STACK_GLOBAL with an int
      "\x8c\x01mN)\x81\x8c\x00\x8c\x00\x93",  // STACK_GLOBAL with empty names
      "K\x01(0",  // POP of a MARK (CPython allows it; DCP never needs it)
  };
  for (const char* body : kBad) {
    std::string bytes = P(body);
    Result<PickleTree> t = ParsePickle(bytes);
    EXPECT_FALSE(t.ok()) << "accepted: " << testing::PrintToString(bytes);
  }
  EXPECT_NE(Debug(P("a")).find("stack underflow"), std::string::npos);
  EXPECT_NE(Debug(P("h\x05")).find("never stored"), std::string::npos);
  // A BUILD applied twice to the same object.
  EXPECT_FALSE(ParsePickle(P("\x8c\x01m\x8c\x01"
                             "C\x93)\x81}b}b"))
                   .ok());
  // Trailing bytes after STOP.
  EXPECT_FALSE(ParsePickle(P("N") + "N").ok());
}

TEST(Pickle, RejectsLengthsPastEnd) {
  const std::string kBad[] = {
      P("X\xff\xff\xff\xff"s),
      P("\x8c\x05"
        "abc"s),
      P("\x8d\xff\xff\xff\xff\xff\xff\xff\xff"s),
      P("\x8e\x00\x00\x00\x00\x00\x00\x00\x80"s),
      P("C\x10"s),
      P("\x95\xff\xff\xff\xff\xff\xff\xff\x7f"s),
      P("\x8a\xff\x01"s),
      P("J\x01\x02"s),
      P("G\x00\x00"s),
      P("cmodule_without_newline"s),
      P("\x8c\x02\xc3\x28"s),  // invalid UTF-8
  };
  for (const std::string& bytes : kBad) {
    EXPECT_FALSE(ParsePickle(bytes).ok()) << testing::PrintToString(bytes);
  }
  EXPECT_NE(Debug(P("X\xff\xff\xff\xff"s)).find("past end"), std::string::npos);
}

TEST(Pickle, DeepNestingIsRejectedNotRecursedInto) {
  // ((((...)))) via TUPLE1, 100000 deep.
  std::string tuples = "\x80\x04)" + std::string(100000, '\x85') + ".";
  Result<PickleTree> t = ParsePickle(tuples);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("depth"), std::string::npos);
  // Lists nested through APPEND.
  std::string lists = "\x80\x04" + std::string(2000, ']');
  for (int i = 0; i < 1999; ++i) lists += 'a';
  lists += '.';
  EXPECT_FALSE(ParsePickle(lists).ok());
  // Unbounded MARKs.
  EXPECT_FALSE(ParsePickle("\x80\x04" + std::string(100000, '(') + ".").ok());
  // Within the limit, fine; and a lower limit is honoured.
  std::string shallow = "\x80\x04)" + std::string(100, '\x85') + ".";
  EXPECT_TRUE(ParsePickle(shallow).ok());
  PickleLimits limits;
  limits.max_depth = 50;
  EXPECT_FALSE(ParsePickle(shallow, limits).ok());
}

TEST(Pickle, CyclesParseAndDebugStringStaysBounded) {
  // l = []; l.append(l)
  Result<PickleTree> t =
      ParsePickle(P("]\x94h\x00"
                    "a"s));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->items(t->root())[0], t->root());
  EXPECT_LE(t->DebugString(t->root(), 100).size(), 103u);
}

TEST(Pickle, MemoBombsAreBounded) {
  // A huge sparse memo key must not allocate a huge table.
  Result<PickleTree> t = ParsePickle(P("N\x72\xf0\xff\xff\xff\x6a\xf0\xff\xff\xff\x86"s));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->DebugString(t->root()), "(None, None)");
  // Exponential sharing: each level holds the previous one twice. The graph stays linear.
  std::string body =
      "]\x94"
      "0";
  for (int i = 1; i <= 60; ++i) {
    std::string prev(1, static_cast<char>(i - 1));
    body += "h" + prev + "h" + prev + "\x86\x94";
    if (i < 60) body += "0";
  }
  t = ParsePickle(P(body));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_LT(t->node_count(), 200u);
  EXPECT_LE(t->DebugString(t->root(), 300).size(), 303u);
  // The entry limit is enforced.
  PickleLimits limits;
  limits.max_memo_entries = 10;
  std::string many = "N";
  for (int i = 0; i < 20; ++i) many += "\x94";
  EXPECT_FALSE(ParsePickle(P(many), limits).ok());
  EXPECT_TRUE(ParsePickle(P(many)).ok());
}

TEST(Pickle, NodeStackContainerAndInputLimits) {
  std::string ints = "(";  // 100 distinct ints (small ones would share one node)
  for (int i = 0; i < 100; ++i) ints += "M" + std::string(1, static_cast<char>(i)) + "\x01";
  ints += "t";
  PickleLimits limits;
  limits.max_nodes = 50;
  EXPECT_FALSE(ParsePickle(P(ints), limits).ok());
  limits = PickleLimits();
  limits.max_container_size = 50;
  EXPECT_FALSE(ParsePickle(P(ints), limits).ok());
  limits = PickleLimits();
  limits.max_stack = 50;
  EXPECT_FALSE(ParsePickle(P(ints), limits).ok());
  limits = PickleLimits();
  limits.max_input_bytes = 10;
  EXPECT_FALSE(ParsePickle(P(ints), limits).ok());
  EXPECT_TRUE(ParsePickle(P(ints)).ok());
  // DUP cannot grow the stack without bound.
  limits = PickleLimits();
  limits.max_stack = 1000;
  EXPECT_FALSE(ParsePickle(P("N" + std::string(5000, '2')), limits).ok());
}

TEST(Pickle, EveryPrefixOfRealMetadataFailsCleanly) {
  for (const char* name : {"torch113_tricky_single_file/.metadata",
                           "torch113_basic_single_file_pickle_proto2/.metadata",
                           "megatron016_torch_dist/.metadata",
                           "torch214_per_rank/__0.metadata"}) {
    std::string bytes = ReadFile(kFixtures / name);
    ASSERT_FALSE(bytes.empty()) << name;
    ASSERT_TRUE(ParsePickle(bytes).ok()) << name;
    for (size_t n = 0; n < bytes.size(); ++n) {
      EXPECT_FALSE(ParsePickle(std::string_view(bytes).substr(0, n)).ok()) << name << " " << n;
    }
  }
}

TEST(Pickle, SingleByteCorruptionsNeverCrash) {
  std::string bytes = ReadFile(kFixtures / "torch113_tricky_single_file/.metadata");
  ASSERT_FALSE(bytes.empty());
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xff, 0x10}) {
      std::string copy = bytes;
      copy[i] = static_cast<char>(copy[i] ^ mask);
      Result<PickleTree> t = ParsePickle(copy);
      if (t.ok()) t->DebugString(t->root(), 500);
    }
  }
}

}  // namespace
}  // namespace ckptfs::store
