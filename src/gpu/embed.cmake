# Turns a binary file into a C++ source holding it as a byte array: cmake -DIN= -DOUT= -DNAME= -P embed.cmake
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE "${OUT}" "// Generated from ${IN}\n#include <cstddef>\nalignas(8) extern const unsigned char ${NAME}[] = {${body}};\nextern const size_t ${NAME}_size = ${bytes};\n")
